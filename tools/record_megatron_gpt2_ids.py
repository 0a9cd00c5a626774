#!/usr/bin/env python
"""Record Megatron-LM's own GPT2BPETokenizer ids for a corpus, for tests/test_gpt2_bpe.py.

    # the files (run once; needs only `tokenizers`): corpus.jsonl, vocab.json, merges.txt
    python tools/record_megatron_gpt2_ids.py make-files --output-dir tests/data/gpt2_bpe
    # Megatron-LM's ids, from a checkout of its source (e.g. `git archive core_v0.16.1 megatron`)
    python tools/record_megatron_gpt2_ids.py record --megatron-lm /path/to/Megatron-LM \\
        --megatron-ref core_v0.16.1 --data-dir tests/data/gpt2_bpe

`record` imports `megatron.training.tokenizer.tokenizer._GPT2BPETokenizer` from the checkout
(what `--tokenizer-type GPT2BPETokenizer --vocab-file --merge-file` builds in Megatron-LM;
the megatron-core wheel does not ship it) and writes, for each corpus line's "text", its
`tokenize(text)` ids to megatron_ids.json (through a temporary name). No Megatron-LM code is
copied here: the test compares our ids with the recorded ones.

`make-files` writes a corpus of hard cases for GPT-2's pre-tokenization regex and BPE
(whitespace runs, Unicode spaces and digits, contractions in both cases, combining marks,
emoji sequences, code, CJK, long words, seeded random strings over all of these) and trains a
small byte-level BPE (GPT-2 file format: vocab.json + merges.txt with its '#version' line)
on this project's docs, sources and that corpus.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import random
import sys

# GPT-2's pre-tokenization regex (Megatron-LM's gpt2_tokenization.py, `self.pat`).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HAND_WRITTEN = [
    "Hello world! It's a test: don't, won't, I'm, you're, we've, they'll, she'd.",
    "DON'T SHOUT. IT'S FINE. I'M HERE. WE'VE GOT IT. THEY'LL SEE. SHE'D KNOW. O'Neil's cat's toy.",
    "tabs\tand  double  spaces   triple    quad\n\nnew lines\r\nCRLF\rCR  \n  trailing   ",
    "     leading spaces",
    "trailing spaces      ",
    "\n\n\n\n",
    " ",
    "",
    "x" * 300,
    "a" * 1000 + " " + "ab" * 500,
    "Numbers: 0 1 12 123 1234 12345 3.14159 1e-10 0xFF 1,000,000 2026-12-01 10:45:00 +49 (0)30 1234567",
    "Unicode digits: ٣٤٥ ۱۲۳ १२३ ௧௨ ² ³ ½ ¾ Ⅻ ⅷ 𝟙𝟚𝟛 ①②③",
    "Accents: café naïve façade résumé Zürich Øresund Łódź Ångström São Paulo",
    "Combining: cafe\u0301 n\u0303 a\u0308\u0304 \u0301alone e\u0301\u0301\u0301",
    "Greek Καλημέρα κόσμε, Cyrillic Привет мир, Armenian Բարեւ, Georgian გამარჯობა",
    "Hebrew שלום עולם and Arabic مرحبا بالعالم with RTL mark \u200f and LTR \u200e",
    "CJK: 你好，世界。日本語のテキスト、カタカナ。한국어 텍스트입니다.",
    "Thai สวัสดีชาวโลก Devanagari नमस्ते दुनिया Tamil வணக்கம்",
    "Emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇩🇪🇯🇵 ❤️ ✔︎ 🤖🚀✨",
    "Spaces: a\u00a0b\u2009c\u3000d\u2028e\u2029f\u0085g\u000bh\u000ci\u001cj\u001dk\u001el\u001fm\u200bn\ufeffo",
    "Mixed ws:  \u00a0 \u3000\u3000 x \t\u00a0\t y\u2003\u2003z",
    "Control chars: \x00\x01\x02\x07\x08\x1b[31mred\x1b[0m\x7f",
    "Quotes: \u2018single\u2019 \u201cdouble\u201d \u00abguillemets\u00bb it\u2019s don\u2019t 's 't 're 've 'm 'll 'd 'S 'T",
    "'s's's 'll've 're'd x's y't z're '  's  'd'",
    "Punctuation runs: !!! ??? ... --- ___ *** ### $$$ %%% &&& @@@ ~~~ ``` ''' \"\"\" ;;; ::: ,,, ... <<>> [[]] {{}}",
    "<|endoftext|> is text here, not the special id: <|endoftext|><|endoftext|>",
    "URL https://example.com/path?q=1&r=two#frag mail a.b+c@example.org path C:\\Users\\x\\file.txt",
    "def f(x, *args, **kwargs):\n    \"\"\"Doc.\"\"\"\n    if x >= 10 and not args:\n        return {'k': [1, 2, 3]}\n\treturn None\n",
    "#include <stdio.h>\nint main(void) {\n    printf(\"%d\\n\", 42);\n    return 0;\n}\n",
    "for (let i = 0; i < n; i++) { arr[i] = i ** 2; } // comment\n/* block */ const x = a?.b ?? c;",
    "SELECT id, name FROM users WHERE age >= 21 AND name LIKE '%son' ORDER BY id DESC;",
    "$ echo \"$HOME\" && ls -la | grep -v '^d' > out.txt 2>&1",
    "Math: ∑_{i=1}^{n} x_i² ≤ ∞, ∀x ∈ ℝ: x·y ≠ 0, α+β=γ, √2 ≈ 1.414, ∂f/∂x",
    "Symbols: © ® ™ € £ ¥ ₹ ₿ § ¶ † ‡ • … ‰ ′ ″ ← → ↔ ⇒ ♠ ♥ ♦ ♣ ☃ ★",
    "Fullwidth: ＡＢＣ１２３！？　ｶﾀｶﾅ",
    "Mathematical letters: 𝐀𝐁𝐂 𝓐𝓑𝓒 𝔸𝔹ℂ and old scripts 𐌰𐌱𐌲 𓀀𓀁",
    "CamelCaseIdentifiers and snake_case_names and kebab-case-names and SCREAMING_SNAKE",
    "Hyphenated well-known state-of-the-art co-operate e-mail re-enter",
    "Numbers glued: abc123def 123abc abc123 1st 2nd 3rd 4th v2.0.1 x86_64 mp3 H2O",
]

# Characters the random strings draw from: every class GPT-2's regex separates, and the
# whitespace and digit edge cases where regex engines' Unicode tables may differ.
RANDOM_POOL = (list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789") + [" "] * 12 +
               list("\t\n\r\x0b\x0c\x1c\x1d\x1e\x1f\x85\xa0\u1680\u2000\u2007\u200a\u200b\u2028\u2029\u202f"
                    "\u205f\u3000\ufeff\u180e") +
               list("'''\"!?.,;:-_()[]{}<>/\\|@#$%^&*+=~`") + ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S"] +
               list("éüßøłñçÆŒÞðĳ\u0301\u0308\u0327\u20dd") + list("ΑαБбԱա你好日本語한국ไทยहिन्दी") +
               list("٣۱१௧²³½Ⅻⅷ①𝟙") + ["😀", "👍🏽", "👨‍👩‍👧", "🇩🇪", "❤️", "\u200d", "\ufe0f"] +
               ["the", " the", " and", " of", " tokenizer", " model", "ing", "tion", " def", "    ", "\n\n"])


def make_corpus(seed: int = 1234, random_docs: int = 300) -> list[str]:
    rng = random.Random(seed)
    docs = list(HAND_WRITTEN)
    for _ in range(random_docs):
        docs.append("".join(rng.choice(RANDOM_POOL) for _ in range(rng.randint(1, 120))))
    # Prose the BPE was trained on: long merges get used.
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    docs.extend(readme[i:i + 2000] for i in range(0, min(len(readme), 20000), 2000))
    return docs


def make_files(output_dir: str, vocab_size: int) -> None:
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    os.makedirs(output_dir, exist_ok=True)
    corpus = make_corpus()
    with open(os.path.join(output_dir, "corpus.jsonl.tmp"), "w", encoding="utf-8") as f:
        for text in corpus:
            f.write(json.dumps({"text": text}, ensure_ascii=True) + "\n")
    os.replace(os.path.join(output_dir, "corpus.jsonl.tmp"), os.path.join(output_dir, "corpus.jsonl"))
    texts = list(corpus)
    for pattern in ("docs/*.md", "megatron_lev/**/*.py"):
        for path in sorted(glob.glob(os.path.join(REPO, pattern), recursive=True)):
            with open(path, encoding="utf-8") as f:
                texts.append(f.read())
    # Trained over a case-insensitive variant of GPT-2's regex, so that merges such as "' T"
    # and "' LL" exist: GPT-2's own regex splits "'T" (upper case) into "'" and "T", and the
    # ids then tell the two regexes apart (upper-case contractions are frequent in the texts).
    texts.extend([HAND_WRITTEN[1]] * 50)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex("(?i:'s|'t|'re|'ve|'m|'ll|'d)" + GPT2_PATTERN[len("'s|'t|'re|'ve|'m|'ll|'d"):]),
                             "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.model.save(output_dir)  # vocab.json + merges.txt ('#version: 0.2' first): GPT-2's format
    print(f"wrote {output_dir}/corpus.jsonl ({len(corpus)} texts), vocab.json ({tok.get_vocab_size()} tokens), "
          "merges.txt")


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def record(megatron_lm: str, megatron_ref: str, data_dir: str) -> None:
    sys.path.insert(0, os.path.abspath(megatron_lm))
    from megatron.training.tokenizer.tokenizer import _GPT2BPETokenizer

    vocab, merges = os.path.join(data_dir, "vocab.json"), os.path.join(data_dir, "merges.txt")
    tokenizer = _GPT2BPETokenizer(vocab, merges)
    with open(os.path.join(data_dir, "corpus.jsonl"), encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    ids = [tokenizer.tokenize(text) for text in texts]
    out = {"megatron_lm": megatron_ref, "tokenizer": "megatron.training.tokenizer.tokenizer._GPT2BPETokenizer",
           "vocab_sha256": sha256(vocab), "merges_sha256": sha256(merges), "vocab_size": tokenizer.vocab_size,
           "eod": tokenizer.eod, "texts": len(texts), "ids_total": sum(map(len, ids)), "ids": ids}
    path = os.path.join(data_dir, "megatron_ids.json")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(out, f, separators=(",", ":"))
    os.replace(path + ".tmp", path)
    print(f"wrote {path}: {len(texts)} texts, {out['ids_total']} ids, vocab {out['vocab_size']}, eod {out['eod']}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make-files", help="write corpus.jsonl, vocab.json, merges.txt")
    m.add_argument("--output-dir", required=True)
    m.add_argument("--vocab-size", type=int, default=3000)
    r = sub.add_parser("record", help="Megatron-LM's ids for the corpus -> megatron_ids.json")
    r.add_argument("--megatron-lm", required=True, help="a Megatron-LM source checkout (the folder holding megatron/)")
    r.add_argument("--megatron-ref", required=True, help="which Megatron-LM it is, e.g. core_v0.16.1")
    r.add_argument("--data-dir", required=True, help="the folder make-files wrote")
    args = p.parse_args(argv)
    if args.command == "make-files":
        make_files(args.output_dir, args.vocab_size)
    else:
        record(args.megatron_lm, args.megatron_ref, args.data_dir)


if __name__ == "__main__":
    main()
