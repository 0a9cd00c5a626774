"""Tokenizers for pre-training, on megatron-core's `MegatronTokenizerBase`.

    tok = build_tokenizer("SentencePieceTokenizer", "tok.model")
    ids = tok.tokenize("def f(x):")          # list[int], no BOS/EOD added
    tok.detokenize(ids), tok.vocab_size, tok.eod, tok.bos, tok.pad

Special tokens are explicit: `eod` ends every document when preprocessing with
--append-eod and is what GPTDataset uses for --eod-mask-loss / --reset-position-ids;
`bos` is the model's begin-of-sequence id (None when the vocabulary has none); `pad`
fills short samples (megatron-core masks it out of the loss) and is -1 when the
vocabulary has no pad token, an id that never occurs in data.

`train_sentencepiece(...)` trains the SentencePiece models these classes load
(tools/train_tokenizer.py is its command line).
"""
from __future__ import annotations

import json
import os
from collections import OrderedDict
from typing import Iterable, Iterator, Sequence

from megatron.core.tokenizers import MegatronTokenizerBase

NO_PAD = -1  # megatron-core's own "no pad token" id: never a real token, masked from the loss


class _PretrainingTokenizer(MegatronTokenizerBase):
    """What GPTDataset and the preprocessing tool need from a tokenizer."""

    def __init__(self, path: str, **options):
        super().__init__(path, {"library": type(self).__name__})
        self.options = {k: v for k, v in options.items() if v is not None}

    @property
    def unique_identifiers(self) -> OrderedDict:
        """Identity of the tokenizer for megatron-core's dataset cache keys."""
        ids = OrderedDict(**{"class": type(self).__name__, "tokenizer_path": os.path.abspath(self.path)})
        ids.update((k, str(v)) for k, v in sorted(self.options.items()))
        return ids

    @property
    def eos(self) -> int:
        return self.eod

    @property
    def special_tokens(self) -> dict:
        return {"eod": self.eod, "bos": self.bos, "pad": self.pad}

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} is a pre-training tokenizer: it has no chat template")

    def describe(self) -> dict:
        """JSON-able summary (written next to preprocessed datasets and into checkpoints'
        config): `sha256` identifies the tokenizer by content, whatever its path."""
        return {"type": type(self).__name__, "model": os.path.abspath(self.path),
                "sha256": tokenizer_sha256(self.path), "vocab_size": self.vocab_size, **self.special_tokens}


# A Hugging Face tokenizer folder's files that decide its ids and special tokens.
_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def tokenizer_sha256(path: str, *more_files: str) -> str:
    """SHA-256 of a tokenizer's content: the model file's bytes (then those of `more_files`,
    such as GPT-2's merges.txt), or for a folder, the name and bytes of each of its
    tokenizer.json, tokenizer_config.json and special_tokens_map.json present. Equal content
    gives an equal hash at any path."""
    import hashlib

    sha = hashlib.sha256()
    files = [os.path.join(path, name) for name in _HF_TOKENIZER_FILES] if os.path.isdir(path) else [path]
    if more_files:
        files = [path, *more_files]
    for i, file in enumerate(files):
        if not os.path.isfile(file):
            continue
        if more_files:  # the files' order, not their names, tells them apart
            sha.update(b"\0%d\0" % i)
        elif len(files) > 1:
            sha.update(os.path.basename(file).encode() + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(1 << 20):
                sha.update(chunk)
    return sha.hexdigest()


class SentencePieceTokenizer(_PretrainingTokenizer):
    """A SentencePiece model: EOD is its `</s>` (eos) piece, BOS `<s>`, PAD its pad piece."""

    def __init__(self, path: str):
        import sentencepiece

        super().__init__(path)
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
        except (RuntimeError, OSError) as exc:  # a damaged or foreign file: SentencePiece's own words
            raise ValueError(f"--tokenizer-model {path}: not a valid SentencePiece model ({_first_line(exc)})") from None
        if self._sp.eos_id() < 0:
            raise ValueError(f"--tokenizer-model {path}: the SentencePiece model has no eos piece, "
                             "which pre-training needs as the end-of-document token")

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def vocab(self) -> dict[str, int]:
        return {self._sp.id_to_piece(i): i for i in range(self.vocab_size)}

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: self._sp.id_to_piece(i) for i in range(self.vocab_size)}

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    @property
    def bos(self) -> int | None:
        return self._sp.bos_id() if self._sp.bos_id() >= 0 else None

    @property
    def pad(self) -> int:
        return self._sp.pad_id() if self._sp.pad_id() >= 0 else NO_PAD

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def tokenize_batch(self, texts: Sequence[str], num_threads: int = -1) -> list[list[int]]:
        """Many texts in one call, in SentencePiece's C++ threads (-1: one per core)."""
        return self._sp.encode(list(texts), out_type=int, num_threads=num_threads)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


# Names tried, in order, when a Hugging Face tokenizer does not say which token is which.
_HF_EOD_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
_HF_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
_HF_PAD_NAMES = ("<pad>", "<|padding|>", "<|pad|>", "[PAD]")


class HuggingFaceTokenizer(_PretrainingTokenizer):
    """A Hugging Face `tokenizers` tokenizer: a tokenizer.json file or a folder holding one (or,
    through build_tokenizer, a Hub model name such as EleutherAI/gpt-neox-20b, as Megatron-LM's
    HuggingFaceTokenizer takes). Ids are the text's alone: no BOS/EOS is added (Megatron's
    AutoTokenizer call adds the tokenizer's own, e.g. Llama's BOS).

    Special tokens come from the arguments, else from tokenizer_config.json /
    special_tokens_map.json in the same folder, else from the usual names
    (<|endoftext|>, </s>, ...). A vocabulary without an end-of-document token is refused.
    """

    def __init__(self, path: str, eod_token: str | None = None, bos_token: str | None = None,
                 pad_token: str | None = None):
        from tokenizers import Tokenizer

        super().__init__(path, eod_token=eod_token, bos_token=bos_token, pad_token=pad_token)
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(f"--tokenizer-model {path}: no tokenizer.json there")
        try:
            self._tok = Tokenizer.from_file(file)
        except Exception as exc:  # tokenizers raises a bare Exception for a damaged file
            raise ValueError(f"--tokenizer-model {file}: not a valid tokenizer.json ({_first_line(exc)})") from None
        self._vocab_size = None
        declared = _hf_declared_special_tokens(folder)
        self._eod = self._special_id(eod_token or declared.get("eos_token"), _HF_EOD_NAMES)
        if self._eod is None:
            raise ValueError(f"--tokenizer-model {path}: no end-of-document token found (looked for "
                             f"{', '.join(_HF_EOD_NAMES)}); name it with eod_token=")
        self._bos = self._special_id(bos_token or declared.get("bos_token"), _HF_BOS_NAMES)
        pad = self._special_id(pad_token or declared.get("pad_token"), _HF_PAD_NAMES)
        self._pad = NO_PAD if pad is None else pad

    def _special_id(self, declared: str | None, candidates: Sequence[str]) -> int | None:
        if declared is not None:
            token_id = self._tok.token_to_id(declared)
            if token_id is None:
                raise ValueError(f"--tokenizer-model {self.path}: special token {declared!r} is not in the vocabulary")
            return token_id
        return next((i for i in map(self._tok.token_to_id, candidates) if i is not None), None)

    @property
    def vocab_size(self) -> int:
        """The highest id + 1: a vocabulary may leave ids unused (o200k_base converted by
        tools/tiktoken_to_hf.py: 199,998 ranks, <|endoftext|> 199999, <|endofprompt|> 200018),
        and the model needs a row for every id, where get_vocab_size counts the entries."""
        if self._vocab_size is None:
            self._vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        return self._vocab_size

    @property
    def vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: t for t, i in self.vocab.items()}

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def bos(self) -> int | None:
        return self._bos

    @property
    def pad(self) -> int:
        return self._pad

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str], num_threads: int = -1) -> list[list[int]]:
        """Many texts in one call (threads: the tokenizers library's own pool, which
        TOKENIZERS_PARALLELISM governs; `num_threads` is accepted for a common interface)."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _hf_declared_special_tokens(folder: str) -> dict[str, str]:
    """eos/bos/pad token strings from tokenizer_config.json or special_tokens_map.json."""
    found: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        file = os.path.join(folder, name)
        if not os.path.isfile(file):
            continue
        try:
            with open(file, encoding="utf-8") as f:
                config = json.load(f)
        except (UnicodeDecodeError, ValueError) as exc:
            raise ValueError(f"{file}: not valid JSON ({_first_line(exc)})") from None
        if not isinstance(config, dict):
            raise ValueError(f"{file}: not a JSON object")
        for key in ("eos_token", "bos_token", "pad_token"):
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                found.setdefault(key, value)
    return found


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class GPT2BPETokenizer(_PretrainingTokenizer):
    """Megatron-LM's GPT2BPETokenizer (The Pile's recipe): GPT-2's byte-level BPE read from a
    vocab.json (--vocab-file) and a merges.txt (--merge-file); EOD is '<|endoftext|>', there
    is no BOS and no PAD, and the vocabulary size is the vocab file's entry count.

    The BPE and the pre-tokenization (GPT-2's regex, no prefix space) run in Hugging Face
    `tokenizers`; the files are read as Megatron-LM's gpt2_tokenization.py reads them, so the
    ids equal Megatron's (tests/test_gpt2_bpe.py checks ids recorded from Megatron-LM itself).
    '<|endoftext|>' inside a text is ordinary text there, as it is in Megatron.
    """

    def __init__(self, vocab_file: str, merge_file: str):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        super().__init__(vocab_file, merge_file=os.path.abspath(merge_file))
        self.vocab_file, self.merge_file = vocab_file, merge_file
        self._vocab = _read_gpt2_vocab(vocab_file)
        self._merges = _read_gpt2_merges(merge_file)
        missing = [s for s in pre_tokenizers.ByteLevel.alphabet() if s not in self._vocab]
        if missing:  # Megatron would map them to id 0 silently
            raise ValueError(f"--vocab-file {vocab_file}: lacks {len(missing)} of the 256 byte symbols "
                             f"(e.g. {missing[0]!r}): not a byte-level BPE vocabulary")
        if GPT2_EOD not in self._vocab:
            raise ValueError(f"--vocab-file {vocab_file}: no {GPT2_EOD} entry (the end-of-document token)")
        try:
            model = models.BPE(self._vocab, self._merges)
        except Exception as exc:  # tokenizers: a merge whose parts or result are not in the vocabulary
            raise ValueError(f"--merge-file {merge_file}: does not fit --vocab-file {vocab_file} "
                             f"({_first_line(exc)})") from None
        self._tok = Tokenizer(model)
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        self._tok.decoder = decoders.ByteLevel()

    def backend_tokenizer(self):
        """A copy of the `tokenizers.Tokenizer` that encodes (what a tokenizer.json holds)."""
        from tokenizers import Tokenizer

        return Tokenizer.from_str(self._tok.to_str())

    def describe(self) -> dict:
        return {**super().describe(), "merge_file": os.path.abspath(self.merge_file),
                "sha256": tokenizer_sha256(self.vocab_file, self.merge_file)}

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)  # Megatron: len(encoder)

    @property
    def vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: t for t, i in self._vocab.items()}

    @property
    def eod(self) -> int:
        return self._vocab[GPT2_EOD]

    @property
    def bos(self) -> None:
        return None

    @property
    def pad(self) -> int:
        return NO_PAD

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str], num_threads: int = -1) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


GPT2_EOD = "<|endoftext|>"


def _read_gpt2_vocab(path: str) -> dict[str, int]:
    try:
        with open(path, encoding="utf-8") as f:
            vocab = json.load(f)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"--vocab-file {path}: not a JSON vocabulary ({_first_line(exc)})") from None
    if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
        raise ValueError(f"--vocab-file {path}: not a JSON object of token -> id")
    return vocab


def _read_gpt2_merges(path: str) -> list[tuple[str, str]]:
    """The merges in rank order, read as Megatron-LM reads them: the first line (the
    '#version' header) and the last (empty after the final newline) are dropped, a line is
    split on whitespace, and a pair listed twice takes its later rank."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")[1:-1]
    except UnicodeDecodeError as exc:
        raise ValueError(f"--merge-file {path}: not UTF-8 text ({_first_line(exc)})") from None
    rank = {}
    for i, line in enumerate(lines):
        pair = tuple(line.split())
        if len(pair) == 2:  # other lines never match a pair of symbols in Megatron either
            rank[pair] = i
    return sorted(rank, key=rank.__getitem__)


class Llama2Tokenizer(SentencePieceTokenizer):
    """Megatron-LM's Llama2Tokenizer: a SentencePiece model whose every text starts with BOS
    (its `tokenize(s, bos=True, eos=False)`); EOD is the eos piece."""

    def tokenize(self, text: str) -> list[int]:
        return self._with_bos(super().tokenize(text))

    def tokenize_batch(self, texts: Sequence[str], num_threads: int = -1) -> list[list[int]]:
        return [self._with_bos(ids) for ids in super().tokenize_batch(texts, num_threads)]

    def _with_bos(self, ids: list[int]) -> list[int]:
        if self.bos is None:
            raise ValueError(f"--tokenizer-model {self.path}: Llama2Tokenizer needs a bos piece, the model has none")
        return [self.bos, *ids]


TOKENIZER_TYPES = {
    "SentencePieceTokenizer": SentencePieceTokenizer,
    # Megatron-LM's name for the same thing (EOD = the model's eos piece).
    "GPTSentencePieceTokenizer": SentencePieceTokenizer,
    "Llama2Tokenizer": Llama2Tokenizer,
    "HuggingFaceTokenizer": HuggingFaceTokenizer,
    "GPT2BPETokenizer": GPT2BPETokenizer,
}


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | None = None, vocab_file: str | None = None,
                    merge_file: str | None = None, **options) -> _PretrainingTokenizer:
    """The tokenizer for --tokenizer-type / --tokenizer-model (GPT2BPETokenizer: --vocab-file
    and --merge-file instead), with a clear error for bad flags."""
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(f"--tokenizer-type {tokenizer_type}: unknown (choose from {', '.join(TOKENIZER_TYPES)})")
    if tokenizer_type == "GPT2BPETokenizer":
        for flag, path, name in (("--vocab-file", vocab_file, "vocab.json"), ("--merge-file", merge_file, "merges.txt")):
            if not path:
                raise ValueError(f"--tokenizer-type GPT2BPETokenizer needs {flag} (GPT-2's {name})")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{flag} {path}: no such file")
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer" and tokenizer_model and not os.path.exists(tokenizer_model):
        tokenizer_model = hub_tokenizer_folder(tokenizer_model)  # a Hub name, as Megatron's AutoTokenizer takes
    if not tokenizer_model or not os.path.exists(tokenizer_model):
        raise FileNotFoundError(f"--tokenizer-model {tokenizer_model}: no such file")
    return TOKENIZER_TYPES[tokenizer_type](tokenizer_model, **options)


def hub_tokenizer_folder(name: str) -> str:
    """The Hugging Face Hub cache's folder holding model `name`'s tokenizer.json (with its
    tokenizer_config.json / special_tokens_map.json when cached). The cache only: every rank of
    a job reads the same files, and no rank downloads (fetch once with `hf download`)."""
    from huggingface_hub import hf_hub_download

    if name.startswith((".", "/", "~")) or name.endswith((".json", ".model")) or name.count("/") > 1:
        raise FileNotFoundError(f"--tokenizer-model {name}: no such file")
    try:
        file = hf_hub_download(name, "tokenizer.json", local_files_only=True)
    except Exception:  # not cached, or not a valid repository name
        raise FileNotFoundError(
            f"--tokenizer-model {name}: no such file, nor a Hugging Face Hub tokenizer in this machine's cache "
            f"(fetch it once: hf download {name} tokenizer.json tokenizer_config.json special_tokens_map.json)"
        ) from None
    return os.path.dirname(file)  # the snapshot folder: the optional files sit beside it when cached


# ---------------------------------------------------------------------------------------
# Training


def training_sentences(texts: Iterable[str]) -> Iterator[str]:
    """Documents -> the lines SentencePiece trains on (non-blank lines, newline dropped;
    newlines are encoded through byte fallback, as in LLaMA's tokenizer)."""
    for text in texts:
        for line in text.split("\n"):
            if line.strip():
                yield line


def train_sentencepiece(sentences: Iterable[str], model_path: str, vocab_size: int, model_type: str = "bpe",
                        byte_fallback: bool = True, user_defined_symbols: Sequence[str] = (),
                        sample_sentences: int = 10_000_000, character_coverage: float = 0.9999,
                        max_sentence_length: int = 16384, num_threads: int | None = None, seed: int = 1234,
                        pad: bool = True) -> SentencePieceTokenizer:
    """Train a lossless SentencePiece model for pre-training; write `model_path` (+ .vocab).

    Lossless: no normalisation, whitespace kept as is (code and indentation survive
    encode -> decode), digits split, unknown characters fall back to bytes. Ids:
    0 <unk>, 1 <s> (bos), 2 </s> (eod), 3 <pad> (when `pad`), then user-defined
    symbols, then the learned pieces. `sample_sentences` caps how many of the given
    sentences SentencePiece keeps (a seeded random sample). The files appear under
    their final names only when training succeeded.
    """
    import sentencepiece

    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"--model-type {model_type}: choose bpe or unigram")
    if not model_path.endswith(".model"):
        raise ValueError(f"--output {model_path}: a SentencePiece model file must end with .model")
    prefix = model_path[: -len(".model")]
    directory = os.path.dirname(os.path.abspath(model_path))
    os.makedirs(directory, exist_ok=True)
    tmp_prefix = os.path.join(directory, f".{os.path.basename(prefix)}.tmp-{os.getpid()}")
    sentencepiece.set_random_generator_seed(seed)
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences), model_prefix=tmp_prefix, vocab_size=vocab_size,
            model_type=model_type, byte_fallback=byte_fallback,
            user_defined_symbols=list(user_defined_symbols), character_coverage=character_coverage,
            input_sentence_size=sample_sentences, shuffle_input_sentence=True,
            max_sentence_length=max_sentence_length, num_threads=num_threads or os.cpu_count() or 1,
            normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
            allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2, pad_id=3 if pad else -1,
            minloglevel=2,
        )
        os.replace(tmp_prefix + ".vocab", prefix + ".vocab")
        os.replace(tmp_prefix + ".model", model_path)
    finally:
        for suffix in (".model", ".vocab"):
            if os.path.exists(tmp_prefix + suffix):
                os.remove(tmp_prefix + suffix)
    return SentencePieceTokenizer(model_path)
