#!/usr/bin/env python
"""Train a SentencePiece tokenizer (BPE or unigram) on a sample of JSON-lines documents.

    python tools/train_tokenizer.py --input /data/pile/train/00.jsonl.zst \
        --output /data/tok/pile_bpe_50k.model --vocab-size 50000 --sample-documents 2000000

The model is lossless (no normalisation, whitespace kept, byte fallback for unseen
characters), with ids 0 <unk>, 1 <s>, 2 </s> (the EOD token), 3 <pad>, then the
--user-defined-symbols, then learned pieces. Files appear under their final names only
when training succeeded.
"""
import argparse
import itertools
import os
import sys
import time

from megatron_lev.data.corpus import read_documents
from megatron_lev.data.tokenizer import train_sentencepiece, training_sentences


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="files, globs or directories of JSON-lines documents")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys whose text is used")
    p.add_argument("--output", required=True, help="model file to write (.model; a .vocab is written beside it)")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    p.add_argument("--no-byte-fallback", dest="byte_fallback", action="store_false",
                   help="map unseen characters to <unk> instead of their UTF-8 bytes")
    p.add_argument("--user-defined-symbols", nargs="*", default=[],
                   help="special tokens that are never split, e.g. '<|im_start|>' '<|im_end|>'")
    p.add_argument("--sample-documents", type=int, default=1_000_000,
                   help="documents read from the start of the input (the sample)")
    p.add_argument("--sample-sentences", type=int, default=10_000_000,
                   help="lines SentencePiece keeps from them (a seeded random sample)")
    p.add_argument("--character-coverage", type=float, default=0.9999)
    p.add_argument("--max-sentence-length", type=int, default=16384, help="longer lines are skipped (bytes)")
    p.add_argument("--num-threads", type=int, default=os.cpu_count())
    p.add_argument("--seed", type=int, default=1234)
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    skipped = []
    try:
        records = read_documents(args.input, keys=args.json_keys, on_bad=skipped.append)
        texts = (text for record in itertools.islice(records, args.sample_documents) for text in record.texts)
        start = time.monotonic()
        tok = train_sentencepiece(
            training_sentences(texts), args.output, args.vocab_size, model_type=args.model_type,
            byte_fallback=args.byte_fallback, user_defined_symbols=args.user_defined_symbols,
            sample_sentences=args.sample_sentences, character_coverage=args.character_coverage,
            max_sentence_length=args.max_sentence_length, num_threads=args.num_threads, seed=args.seed)
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    if skipped:
        print(f"skipped {len(skipped)} bad record(s), first: {skipped[0]}", file=sys.stderr)
    print(f"wrote {args.output}: vocab {tok.vocab_size}, eod {tok.eod}, bos {tok.bos}, pad {tok.pad} "
          f"({time.monotonic() - start:.1f}s)")


if __name__ == "__main__":
    main()
