"""A tiktoken encoding as a Hugging Face tokenizer.json (tools/tiktoken_to_hf.py).

    python tools/tiktoken_to_hf.py --encoding /data/tok/o200k_base.tiktoken --like o200k_base \
        --output /data/tok/o200k --check /data/pile/val.jsonl.zst   # compared with tiktoken first
    python tools/tiktoken_to_hf.py --encoding o200k_base --output /data/tok/o200k   # where tiktoken can fetch it

The output folder holds tokenizer.json and tokenizer_config.json (eos_token <|endoftext|>, no
BOS/EOS added when encoding), which `tools/preprocess_data.py --tokenizer-type
HuggingFaceTokenizer --tokenizer-model FOLDER/tokenizer.json`, the trainer and the exports read.
With `--check CORPUS` the first `--check-documents` (1000) documents are encoded by tiktoken and
by the new tokenizer; a difference is an error and nothing is written.

The vocabulary and the merges (rebuilt from the ranks) come from transformers' own
`TikTokenConverter`. One change: it appends the special tokens after the ranks, while tiktoken
numbers them itself (o200k_base: <|endoftext|> 199999 and <|endofprompt|> 200018, after 199,998
ranks); here they keep tiktoken's ids, so both tokenizers give the same ids. A `.tiktoken` file
holds only the ranks: its split pattern and special tokens are those of the named encoding
`--like` (read without downloading its ranks), plus `--special-token NAME=ID`.

`.tiktoken` files are read and written here (`read_ranks`, `write_ranks`: one `base64(token)
rank` line per token, tiktoken's format) rather than by tiktoken's `load_tiktoken_bpe`, which
caches every file it reads by its path (so a changed file at the same path reads as the old
one). Where the real o200k_base file comes from: docs/cluster.md "3. The tokenizer".
"""
from __future__ import annotations

import base64
import binascii
import os
from typing import Optional
from unittest import mock

from megatron_lev.utils.files import atomic_path, write_json_atomic, write_text_atomic

ENDOFTEXT = "<|endoftext|>"


def named_encoding_parts(name: str) -> tuple[str, dict[str, int]]:
    """(split pattern, special tokens) of one of tiktoken's named encodings, without its ranks
    (no download: the constructor's rank loader is stubbed)."""
    import tiktoken_ext.openai_public as public

    constructor = public.ENCODING_CONSTRUCTORS.get(name)
    if constructor is None:
        raise ValueError(f"--like {name}: not one of tiktoken's encodings ({', '.join(public.ENCODING_CONSTRUCTORS)})")
    with mock.patch.object(public, "load_tiktoken_bpe", lambda *args, **kwargs: {}):
        parts = constructor()
    return parts["pat_str"], dict(parts["special_tokens"])


def read_ranks(path: str) -> dict[bytes, int]:
    """A .tiktoken file's mergeable ranks; a malformed line or a repeated rank is refused in one
    line naming the file and line."""
    ranks: dict[bytes, int] = {}
    seen: dict[int, int] = {}
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            parts = line.split()
            try:
                if len(parts) != 2:
                    raise ValueError("expected 'base64 rank'")
                token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
            except (ValueError, binascii.Error) as exc:
                raise ValueError(f"--encoding {path}: not a .tiktoken file (line {number}: {exc})") from None
            if rank in seen or token in ranks:
                raise ValueError(f"--encoding {path}: line {number} repeats rank {rank} or its token (line "
                                 f"{seen.get(rank) or seen[ranks[token]]})")
            ranks[token], seen[rank] = rank, number
    if not ranks:
        raise ValueError(f"--encoding {path}: not a .tiktoken file (no ranks)")
    return ranks


def write_ranks(ranks: dict[bytes, int], path: str) -> None:
    """Write mergeable ranks as a .tiktoken file (tiktoken's format), under a temporary name."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
            f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")


def load_encoding(encoding: str, like: str = "o200k_base",
                  special_tokens: Optional[dict[str, int]] = None) -> tuple[dict[bytes, int], str, dict[str, int]]:
    """(mergeable ranks, pattern, special tokens) of a `.tiktoken` file (with `like`'s pattern and
    special tokens) or of a named encoding tiktoken can load (its cache: TIKTOKEN_CACHE_DIR)."""
    import tiktoken

    if os.path.isfile(encoding):
        ranks = read_ranks(encoding)
        pattern, specials = named_encoding_parts(like)
    elif os.sep in encoding or encoding.endswith(".tiktoken"):
        raise ValueError(f"--encoding {encoding}: no such file")
    elif encoding not in tiktoken.list_encoding_names():
        raise ValueError(f"--encoding {encoding}: neither a file nor one of tiktoken's encodings "
                         f"({', '.join(tiktoken.list_encoding_names())})")
    else:
        try:
            loaded = tiktoken.get_encoding(encoding)
        except Exception as exc:  # no network and no cache: requests' errors
            raise ValueError(f"--encoding {encoding}: tiktoken could not load it ({type(exc).__name__}); download "
                             'its .tiktoken file once where there is network (docs/cluster.md, "3. The tokenizer")'
                             ) from None
        ranks, pattern, specials = loaded._mergeable_ranks, loaded._pat_str, dict(loaded._special_tokens)
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"--encoding {encoding}: byte {missing[0]} is not a token ({len(missing)} of the 256 bytes "
                         "missing): not a byte-level BPE")
    specials = {**specials, **(special_tokens or {})}
    taken = set(ranks.values())
    clash = sorted((token_id, name) for name, token_id in specials.items() if token_id in taken)
    if clash:
        raise ValueError(f"special token {clash[0][1]}={clash[0][0]}: the id is already a token of the encoding's "
                         "ranks (--like, --special-token)")
    return ranks, pattern, specials


def to_hf_tokenizer(ranks: dict[bytes, int], pattern: str, special_tokens: dict[str, int]):
    """The `tokenizers.Tokenizer` of an encoding: transformers' TikTokenConverter (the vocabulary,
    the merges rebuilt from the ranks, tiktoken's split pattern, byte-level), special tokens at
    their tiktoken ids."""
    import tiktoken.load
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class _FromRanks(TikTokenConverter):
        def tokenizer(self):
            # The converter reads a file through tiktoken's loader: hand it the ranks in memory.
            with mock.patch.object(tiktoken.load, "load_tiktoken_bpe", lambda *args, **kwargs: ranks):
                vocab, merges = self.extract_vocab_merges_from_model(None)
            vocab.update(special_tokens)  # an added token already in the vocabulary keeps its id
            tokenizer = Tokenizer(BPE(vocab, merges, fuse_unk=False))
            tokenizer.model.ignore_merges = True  # a piece that is a token is that token (tiktoken's rule)
            return tokenizer

    tokenizer = _FromRanks(vocab_file=None, pattern=pattern).converted()
    tokenizer.add_special_tokens([AddedToken(name, normalized=False, special=True)
                                  for name in sorted(special_tokens, key=special_tokens.get)])
    for name, token_id in special_tokens.items():
        if tokenizer.token_to_id(name) != token_id:
            raise ValueError(f"special token {name}: id {tokenizer.token_to_id(name)} after conversion, {token_id} in "
                             "tiktoken")
    return tokenizer


def check_same_ids(tokenizer, ranks: dict[bytes, int], pattern: str, special_tokens: dict[str, int],
                   corpus: str, documents: int) -> tuple[int, int]:
    """Encode the first `documents` texts of a Pile-format corpus (`.jsonl[.zst|.gz]`) with
    tiktoken and with `tokenizer`, special tokens in the text read as special (what
    preprocessing's HF tokenizer does); returns (documents, tokens), or raises naming the file,
    line and first differing position."""
    import tiktoken

    from megatron_lev.data.corpus import expand_inputs, read_documents

    try:
        files = expand_inputs(corpus, flag="--check")
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from None
    reference = tiktoken.Encoding(name="check", pat_str=pattern, mergeable_ranks=ranks, special_tokens=special_tokens)
    checked = tokens = 0
    records = read_documents(files, on_bad=lambda case: None)  # preprocessing skips malformed records too
    while checked < documents:
        try:
            record = next(records, None)
        except OSError as exc:  # a truncated or corrupt .zst / .gz
            raise ValueError(f"--check {corpus}: {exc}") from None
        if record is None:
            break
        text = record.texts[0]
        expected = reference.encode(text, allowed_special="all")
        got = tokenizer.encode(text, add_special_tokens=False).ids
        if got != expected:
            at = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
            raise ValueError(f"--check {record.path}:{record.line}: ids differ from tiktoken's at token {at} "
                             f"(tiktoken {expected[at:at + 3]}, tokenizer.json {got[at:at + 3]})")
        checked, tokens = checked + 1, tokens + len(expected)
    if not checked:
        raise ValueError(f"--check {corpus}: no documents")
    return checked, tokens


def convert_tiktoken(encoding: str, output: str, like: str = "o200k_base",
                     special_tokens: Optional[dict[str, int]] = None, check: Optional[str] = None,
                     check_documents: int = 1000) -> str:
    """Write OUTPUT/tokenizer.json and tokenizer_config.json (after --check's corpus, if given,
    gave tiktoken's ids); returns a one-line summary."""
    ranks, pattern, specials = load_encoding(encoding, like, special_tokens)
    if ENDOFTEXT not in specials:
        raise ValueError(f"--encoding {encoding}: no {ENDOFTEXT} special token (the end-of-document token "
                         "preprocessing appends): add it with --special-token '<|endoftext|>=ID'")
    tokenizer = to_hf_tokenizer(ranks, pattern, specials)
    summary = f"wrote {output}/tokenizer.json"
    if check:
        documents, tokens = check_same_ids(tokenizer, ranks, pattern, specials, check, check_documents)
        summary += f" (ids equal tiktoken's on {documents} documents, {tokens} tokens, of {check})"
    os.makedirs(output, exist_ok=True)
    write_text_atomic(os.path.join(output, "tokenizer.json"), tokenizer.to_str(pretty=False))
    write_json_atomic(os.path.join(output, "tokenizer_config.json"), {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": ENDOFTEXT, "bos_token": None, "pad_token": None,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False})
    return summary


def parse_special(values: list[str]) -> dict[str, int]:
    out = {}
    for value in values:
        name, sep, token_id = value.rpartition("=")
        if not sep or not name or not token_id.isdigit():
            raise ValueError(f"--special-token {value}: expected NAME=ID, e.g. '<|endoftext|>=199999'")
        out[name] = int(token_id)
    return out


def main(argv=None) -> int:
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="tiktoken_to_hf.py", description="Convert a tiktoken encoding to a Hugging "
                                "Face tokenizer.json (+ tokenizer_config.json).")
    p.add_argument("--encoding", required=True, help="a .tiktoken file, or a name tiktoken can load (o200k_base)")
    p.add_argument("--output", required=True, help="folder to write tokenizer.json and tokenizer_config.json into")
    p.add_argument("--like", default="o200k_base", help="a .tiktoken file's split pattern and special tokens: "
                   "those of this named encoding (default o200k_base)")
    p.add_argument("--special-token", action="append", default=[], metavar="NAME=ID",
                   help="add or renumber a special token (repeatable)")
    p.add_argument("--check", metavar="CORPUS", help="before writing, compare the ids with tiktoken's on this "
                   "Pile-format file (.jsonl, .jsonl.zst, .jsonl.gz); a difference is an error")
    p.add_argument("--check-documents", type=int, default=1000, metavar="N",
                   help="how many of --check's documents to compare (default 1000)")
    args = p.parse_args(argv)
    try:
        if args.check_documents < 1:
            raise ValueError(f"--check-documents {args.check_documents}: must be at least 1")
        summary = convert_tiktoken(args.encoding, args.output, args.like, parse_special(args.special_token),
                                   args.check, args.check_documents)
    except ImportError as exc:  # the conversion's libraries: tiktoken, tokenizers, transformers
        print(f"tiktoken_to_hf: error: {exc.name or exc} is not installed (pip install tiktoken 'transformers>=5')",
              file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:
        print(f"tiktoken_to_hf: error: {exc}", file=sys.stderr)
        return 2
    print(summary)
    return 0
