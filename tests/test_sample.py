"""sample.py as a user runs it. Checkpoints of train.py (every layer class), of nanoGPT and of the
reference implementation that hold the same weights give the same samples as nanoGPT's sampling
loop run on those weights; the encoding is the dataset's meta.pkl, else GPT-2's BPE; bad input
stops with one line on stderr and exit code 2.

Most runs execute sample.py inside the test process (runpy), which saves starting Python and torch
each time; two run it as a subprocess, as a user does."""
import os
import pickle
import re
import runpy
import shutil
import subprocess
import sys
import threading

import pytest
import torch

from conftest import REPO, TINY, run_train
from gns_fixtures import LLAMA
from test_data import fallback_only, gpt2_ranks, pip_fails  # noqa: F401  (gpt2_ranks is a fixture)
from nanogns.layers.config import classes_for_flags, set_contextual_config
from model import GPT, GPTConfig

SAMPLE = os.path.join(REPO, "sample.py")
SEPARATOR = "---------------"
SEED, NUM_SAMPLES, MAX_NEW_TOKENS, TEMPERATURE, TOP_K = 7, 2, 12, 0.9, 5
FLAGS = ["--device=cpu", "--dtype=float32", f"--seed={SEED}", f"--num_samples={NUM_SAMPLES}",
         f"--max_new_tokens={MAX_NEW_TOKENS}", f"--temperature={TEMPERATURE}", f"--top_k={TOP_K}"]
# every class of layer_config's table: the measured Linears and Embeddings with the fused and the
# separated LayerNorm
LAYER_CLASSES = {
    "nn": classes_for_flags(),
    "gns": classes_for_flags(linearclass="gns", embeddingclass="gns", lnclass="fused"),
    "shim": classes_for_flags(linearclass="shim", embeddingclass="shim", lnclass="shim"),
}


def sample_here(monkeypatch, capsys, *args):
    """Run sample.py with args in this process; (exit code, stdout, stderr)."""
    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", [SAMPLE, *args])
    monkeypatch.setattr(sys, "path", list(sys.path))  # sample.py adds data/ to it
    code = 0
    try:
        runpy.run_path(SAMPLE, run_name="__main__")
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def samples_of(model, prompt_ids, decode, top_k=TOP_K):
    """The oracle: what nanoGPT's sample.py prints for model's weights. It seeds, builds a GPT of
    the checkpoint's config (whose initialisation draws from the generator), loads the weights and
    samples; this fork's GPT draws the same numbers, so its samples are nanoGPT's."""
    torch.manual_seed(SEED)
    model_of_checkpoint = GPT(model.config)
    model_of_checkpoint.load_state_dict(model.state_dict())
    model = model_of_checkpoint.eval()
    x = torch.tensor([prompt_ids], dtype=torch.long)
    printed = ""
    for _ in range(NUM_SAMPLES):
        y = model.generate(x, MAX_NEW_TOKENS, temperature=TEMPERATURE, top_k=top_k)
        printed += decode(y[0].tolist()) + "\n" + SEPARATOR + "\n"
    return printed


def read_meta(dataset):
    """(encode, decode, vocab_size) of a character-level dataset."""
    with open(os.path.join(dataset, "meta.pkl"), "rb") as f:
        meta = pickle.load(f)
    return (lambda s: [meta["stoi"][c] for c in s]), (lambda ids: "".join(meta["itos"][i] for i in ids)), meta["vocab_size"]


def random_gpt(vocab_size, **config):
    """A tiny GPT whose every weight is random (gains and biases too), so samples depend on all of them."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=vocab_size, dropout=0.0,
                          device_name="M1_eflops", **config))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def model_args_of(config, keys=None):
    keys = keys or ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size", "dropout", "cos_attn",
                    "spectral_c_attn", "fp32_attention_layers", "device_name", "norm", "mlp", "pos_emb",
                    "tie_embeddings")
    return {k: getattr(config, k) for k in keys}


def save_train_py_checkpoint(model, layers, dataset, out_dir):
    """model's weights in a GPT of the given layer classes, saved as train.py saves it, after one
    backward pass so that the per-example-norm buffers hold sums as they do after training."""
    with set_contextual_config(**LAYER_CLASSES[layers]):
        trained = GPT(model.config)
    trained.load_state_dict(model.state_dict())
    ids = torch.randint(model.config.vocab_size, (2, model.config.block_size))
    trained(ids, ids)[1].backward()
    optimizer = trained.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
    os.makedirs(out_dir, exist_ok=True)
    torch.save({"model": trained.state_dict(), "optimizer": optimizer.state_dict(),
                "scaler": torch.amp.GradScaler("cpu", enabled=False).state_dict(),
                "model_args": model_args_of(model.config), "iter_num": 1, "best_val_loss": 2.5,
                "config": {"dataset": dataset, "linearclass": layers, "out_dir": str(out_dir)}},
               os.path.join(out_dir, "ckpt.pt"))


def save_nanogpt_checkpoint(model, dataset, out_dir):
    """As nanoGPT's train.py saves it: no tokens_processed, its model_args, keys of a compiled model."""
    state_dict = {"_orig_mod." + k: v for k, v in model.state_dict().items() if k != "tokens_processed"}
    model_args = model_args_of(model.config, ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size", "dropout"))
    os.makedirs(out_dir, exist_ok=True)
    torch.save({"model": state_dict, "optimizer": {}, "model_args": model_args, "iter_num": 1,
                "best_val_loss": 2.5, "config": {"dataset": dataset}}, os.path.join(out_dir, "ckpt.pt"))


def save_reference_checkpoint(model, dataset, out_dir):
    """As CerebrasResearch/nanoGNS's train.py saves it: c_attn inside a FusedQKVLinear (.qkv), the
    separated LayerNorm's gain and bias in .affine, a [2] `*_upegsqnorm` buffer per parameter, and
    model_args without fp32_attention_layers."""
    state_dict = {}
    for key, value in model.state_dict().items():
        key = re.sub(r"\.(ln_1|ln_2|ln_f)\.", r".\1.affine.", key.replace(".attn.c_attn.", ".attn.c_attn.qkv."))
        state_dict[key] = value
        if key.endswith((".weight", ".bias")):
            state_dict[key + "_upegsqnorm"] = torch.rand(2)
    assert "transformer.h.0.attn.c_attn.qkv.weight" in state_dict and "transformer.h.1.ln_1.affine.weight" in state_dict
    model_args = model_args_of(model.config, ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size",
                                              "dropout", "device_name", "spectral_c_attn", "cos_attn"))
    os.makedirs(out_dir, exist_ok=True)
    torch.save({"model": state_dict, "optimizer": {}, "model_args": model_args, "iter_num": 1,
                "best_val_loss": 2.5, "config": {"dataset": dataset, "lnclass": "shim"}},
               os.path.join(out_dir, "ckpt.pt"))


@pytest.fixture
def dataset_named_under_data(tiny_dataset):
    """The tiny dataset's meta.pkl under data/<name>, as nanoGPT's checkpoints name their dataset."""
    name = f"test_sample_{os.getpid()}"
    os.makedirs(os.path.join(REPO, "data", name))
    shutil.copy(os.path.join(tiny_dataset, "meta.pkl"), os.path.join(REPO, "data", name))
    yield name
    shutil.rmtree(os.path.join(REPO, "data", name))


@pytest.fixture(scope="module")
def char_checkpoint(tiny_dataset, tmp_path_factory):
    """(out_dir, model) of a character-level checkpoint of plain layers."""
    model = random_gpt(read_meta(tiny_dataset)[2])
    out_dir = str(tmp_path_factory.mktemp("char_out"))
    save_train_py_checkpoint(model, "nn", tiny_dataset, out_dir)
    return out_dir, model


# ---------------------------------------------------------------------------------- samples

@pytest.mark.slow
def test_samples_a_checkpoint_that_train_py_wrote_with_the_gns_layers(tiny_dataset, tmp_path):
    out = tmp_path / "out"
    run_train(*TINY, f"--dataset={tiny_dataset}", f"--out_dir={out}", "--max_iters=30", "--eval_interval=30",
              "--learning_rate=3e-3", "--warmup_tokens=640", "--lr_decay_tokens=1920", "--min_lr=3e-4",
              "--linearclass=gns", "--embeddingclass=gns", "--lnclass=fused")
    p = subprocess.run([sys.executable, SAMPLE, f"--out_dir={out}", *FLAGS, "--start=the "], cwd=REPO,
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert f"Loading meta from {os.path.join(tiny_dataset, 'meta.pkl')}" in p.stdout
    # the oracle: the checkpoint's weights in a GPT of torch's layers, loaded strictly
    checkpoint = torch.load(out / "ckpt.pt", weights_only=False)
    model = GPT(GPTConfig(**checkpoint["model_args"]))
    model.load_state_dict(checkpoint["model"])
    encode, decode, _ = read_meta(tiny_dataset)
    expected = samples_of(model, encode("the "), decode)
    assert p.stdout.endswith(expected)
    assert len(expected.split(SEPARATOR)) == NUM_SAMPLES + 1


@pytest.mark.parametrize("layers", ["nn", "gns", "shim"])
def test_every_layer_class_gives_the_samples_of_its_weights(layers, tiny_dataset, tmp_path, monkeypatch, capsys):
    encode, decode, vocab_size = read_meta(tiny_dataset)
    # cosine attention in block 1 and float32 attention in block 0: model_args reach the model
    model = random_gpt(vocab_size, cos_attn=[1], fp32_attention_layers=[0])
    save_train_py_checkpoint(model, layers, tiny_dataset, tmp_path)
    code, out, err = sample_here(monkeypatch, capsys, f"--out_dir={tmp_path}", *FLAGS, "--start=the ")
    assert code == 0, err
    assert out.endswith(samples_of(model, encode("the "), decode))
    # progress on stderr, one line before each sample, so that stdout holds the samples alone
    progress = [line for line in err.splitlines() if line.startswith("sample ")]
    assert progress == [f"sample {k} of {NUM_SAMPLES}: generating {MAX_NEW_TOKENS} tokens..." for k in (1, 2)]


def test_a_llama_style_checkpoint_gives_the_samples_of_its_weights(tiny_dataset, tmp_path, monkeypatch, capsys):
    """RMSNorm, SwiGLU, rope and an untied head, from model_args: a GPT-2 layout would not load its weights."""
    encode, decode, vocab_size = read_meta(tiny_dataset)
    model = random_gpt(vocab_size, bias=False, **LLAMA)
    save_train_py_checkpoint(model, "gns", tiny_dataset, tmp_path)
    code, out, err = sample_here(monkeypatch, capsys, f"--out_dir={tmp_path}", *FLAGS, "--start=the ")
    assert code == 0, err
    assert out.endswith(samples_of(model, encode("the "), decode))


@pytest.mark.parametrize("writer", ["nanogpt", "reference"])
def test_nanogpt_and_reference_checkpoints_give_the_samples_of_their_weights(
        writer, tiny_dataset, dataset_named_under_data, char_checkpoint, tmp_path, monkeypatch, capsys):
    ours_dir, model = char_checkpoint
    if writer == "nanogpt":  # nanoGPT names its dataset, a folder under data/
        save_nanogpt_checkpoint(model, dataset_named_under_data, tmp_path)
        meta_path = os.path.join(REPO, "data", dataset_named_under_data, "meta.pkl")
    else:
        save_reference_checkpoint(model, tiny_dataset, tmp_path)
        meta_path = os.path.join(tiny_dataset, "meta.pkl")
    code, out, err = sample_here(monkeypatch, capsys, f"--out_dir={tmp_path}", *FLAGS, "--start=the ")
    assert code == 0, err
    assert f"Loading meta from {meta_path}" in out
    encode, decode, _ = read_meta(tiny_dataset)
    expected = samples_of(model, encode("the "), decode)
    assert out.endswith(expected)
    # and what our own checkpoint of the same weights gives
    code, ours, err = sample_here(monkeypatch, capsys, f"--out_dir={ours_dir}", *FLAGS, "--start=the ")
    assert code == 0 and ours.endswith(expected)


def test_prompt_from_a_file_top_k_none_and_a_prompt_longer_than_the_block(
        tiny_dataset, char_checkpoint, tmp_path, monkeypatch, capsys):
    out_dir, model = char_checkpoint
    encode, decode, _ = read_meta(tiny_dataset)
    prompt = "the quick brown fox jumps over the lazy"  # 39 characters, block_size 16: generate crops
    (tmp_path / "prompt.txt").write_text(prompt, encoding="utf-8")
    code, out, err = sample_here(monkeypatch, capsys, f"--out_dir={out_dir}", *FLAGS,
                                 f"--start=FILE:{tmp_path / 'prompt.txt'}", "--top_k=None")
    assert code == 0, err
    expected = samples_of(model, encode(prompt), decode, top_k=None)
    assert out.endswith(expected) and expected.startswith(prompt)
    assert expected != samples_of(model, encode(prompt), decode)  # so top_k=None was not top_k=5


def test_help_lists_nanogpts_keys(monkeypatch, capsys):
    code, out, err = sample_here(monkeypatch, capsys, "--help")
    assert code == 0
    for key in ("--init_from='resume'", "--out_dir='out'", "--start='\\n'", "--num_samples=10",
                "--max_new_tokens=500", "--temperature=0.8", "--top_k=200", "--seed=1337", "--device='cuda'",
                "--dtype=", "--compile=False"):
        assert key in out


# ---------------------------------------------------------------------------------- GPT-2 BPE

@pytest.mark.slow
def test_gpt2_bpe_without_meta_pkl_and_padded_ids_shown_by_number(gpt2_ranks, tmp_path, monkeypatch, capsys):
    fallback_only(monkeypatch, gpt2_ranks)
    import gpt2_bpe
    enc, _ = gpt2_bpe.gpt2_encoding()
    model = random_gpt(50304)  # GPT-2's vocabulary padded, as train.py builds it without meta.pkl
    no_meta = tmp_path / "bpe_dataset"  # a dataset folder without meta.pkl
    no_meta.mkdir()
    save_train_py_checkpoint(model, "nn", str(no_meta), tmp_path / "out")
    code, out, err = sample_here(monkeypatch, capsys, f"--out_dir={tmp_path / 'out'}", *FLAGS, "--start=Hello world")
    assert code == 0, err
    assert "No meta.pkl found, assuming GPT-2 encodings..." in out and "openai-whisper" in out
    assert out.endswith(samples_of(model, [15496, 995], enc.decode))
    # a model that always picks id 50300, past GPT-2's 50257: shown by number, not a crash
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.copy_(torch.nn.functional.normalize(torch.randn(32), dim=0))
        model.transformer.wte.weight[50300] = 50 * model.transformer.ln_f.bias
    save_train_py_checkpoint(model, "nn", str(no_meta), tmp_path / "out")
    code, out, err = sample_here(monkeypatch, capsys, f"--out_dir={tmp_path / 'out'}", *FLAGS, "--start=Hello world")
    assert code == 0, err
    assert out.endswith(("Hello world" + "<|token 50300|>" * MAX_NEW_TOKENS + "\n" + SEPARATOR + "\n") * NUM_SAMPLES)


@pytest.mark.slow
def test_init_from_gpt2_samples_with_gpt2_bpe(gpt2_ranks, tmp_path, monkeypatch, capsys):
    fallback_only(monkeypatch, gpt2_ranks)
    import gpt2_bpe
    enc, _ = gpt2_bpe.gpt2_encoding()
    model = random_gpt(50257)
    asked = []

    def from_pretrained(cls, model_type, override_args=None):  # the hub's weights, without the network
        asked.append((model_type, override_args))
        pretrained = GPT(model.config)  # building draws random numbers, as GPT.from_pretrained's does
        pretrained.load_state_dict(model.state_dict())
        return pretrained
    monkeypatch.setattr(GPT, "from_pretrained", classmethod(from_pretrained))
    code, out, err = sample_here(monkeypatch, capsys, "--init_from=gpt2-medium", *FLAGS, "--start=<|endoftext|>")
    assert code == 0, err
    assert asked == [("gpt2-medium", {"dropout": 0.0})]
    assert out.endswith(samples_of(model, [50256], enc.decode))


@pytest.mark.slow
def test_a_character_model_without_its_meta_pkl_is_refused(gpt2_ranks, char_checkpoint, tmp_path, monkeypatch, capsys):
    fallback_only(monkeypatch, gpt2_ranks)
    _, model = char_checkpoint
    save_train_py_checkpoint(model, "nn", str(tmp_path / "moved_dataset"), tmp_path)
    code, out, err = sample_here(monkeypatch, capsys, f"--out_dir={tmp_path}", *FLAGS)
    assert code == 2
    assert err.strip().splitlines() == [f"error: the model's vocab_size is {model.config.vocab_size}, too small for "
                                        f"GPT-2's BPE (50257): a character-level model whose meta.pkl is not at "
                                        f"{tmp_path / 'moved_dataset' / 'meta.pkl'}?"]


def test_no_gpt2_bpe_to_be_had_is_one_line(tmp_path, monkeypatch, capsys):
    fallback_only(monkeypatch, tmp_path / "empty_cache")
    monkeypatch.setattr(subprocess, "run", pip_fails)
    save_train_py_checkpoint(random_gpt(50304), "nn", str(tmp_path), tmp_path / "out")
    code, out, err = sample_here(monkeypatch, capsys, f"--out_dir={tmp_path / 'out'}", *FLAGS)
    assert code == 2
    err = err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: GPT-2's BPE files cannot be had")


# ---------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("args, words", [
    (["--num_samples=0"], "--num_samples=0 must be at least 1"),
    (["--max_new_tokens=0"], "--max_new_tokens=0 must be at least 1"),
    (["--temperature=0"], "--temperature=0.0 must be a number above 0"),
    (["--temperature=-1.5"], "--temperature=-1.5 must be a number above 0"),
    (["--top_k=0"], "--top_k=0 must be at least 1, or None to keep every token"),
    (["--top_k=many"], "--top_k expects int"),
    (["--device=gpu"], "--device='gpu' is not a device: use cpu, cuda, cuda:N or mps"),
    (["--device=cuda:99"], "--device=cuda:99 but"),
    (["--dtype=fp8"], "--dtype='fp8' is not one of float32, bfloat16, float16"),
    (["--init_from=gpt5"], "--init_from='gpt5' is not one of resume, gpt2, gpt2-medium, gpt2-large, gpt2-xl"),
    (["--no_such_key=1"], "unknown config key 'no_such_key'"),
    (["--start="], "--start is empty"),
    (["--start=FILE:/no/such/prompt.txt"], "cannot read the prompt file /no/such/prompt.txt"),
    (["--start=FILE:/dev/null"], "cannot read the prompt file /dev/null (not a regular file but a device)"),
    (["--start=Quiz"], "--start has characters that"),
])
def test_bad_flags_are_one_line_and_exit_2(args, words, char_checkpoint, monkeypatch, capsys):
    code, out, err = sample_here(monkeypatch, capsys, f"--out_dir={char_checkpoint[0]}", *FLAGS, *args)
    assert code == 2
    err = err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err


def test_a_prompt_file_that_is_a_fifo_is_refused_before_it_is_opened(char_checkpoint, tmp_path, monkeypatch, capsys):
    fifo = tmp_path / "prompt"
    os.mkfifo(fifo)  # opened for reading, it waits for a writer: for ever, where none comes
    done = threading.Event()

    def writer():  # frees a reader that opened it: sample.py then goes on, and the test fails instead of hanging
        while not done.is_set():
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # no reader has it open
                done.wait(0.05)
                continue
            os.write(fd, b"the ")
            os.close(fd)
            return
    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        code, out, err = sample_here(monkeypatch, capsys, f"--out_dir={char_checkpoint[0]}", *FLAGS,
                                     f"--start=FILE:{fifo}")
    finally:
        done.set()
        thread.join()
    assert code == 2 and err == f"error: cannot read the prompt file {fifo} (not a regular file but a FIFO)\n"


def test_a_prompt_file_is_read_up_to_a_bound(char_checkpoint, tmp_path, monkeypatch, capsys):
    (tmp_path / "prompt.txt").write_text("the " * (1 << 18) + "t")  # 1 MiB and a byte, of the model's characters
    code, out, err = sample_here(monkeypatch, capsys, f"--out_dir={char_checkpoint[0]}", *FLAGS,
                                 f"--start=FILE:{tmp_path / 'prompt.txt'}")
    assert code == 2
    assert err == f"error: cannot read the prompt file {tmp_path / 'prompt.txt'} (larger than 1,048,576 bytes)\n"


def test_init_from_gpt2_without_transformers_is_one_line(monkeypatch, capsys):
    def no_transformers(cls, model_type, override_args=None):
        raise ModuleNotFoundError("No module named 'transformers'")
    monkeypatch.setattr(GPT, "from_pretrained", classmethod(no_transformers))
    code, out, err = sample_here(monkeypatch, capsys, "--init_from=gpt2", *FLAGS)
    assert code == 2
    assert err.strip().splitlines() == ["error: --init_from=gpt2 needs the transformers package and network access "
                                        "to download the weights, and that failed: ModuleNotFoundError: No module "
                                        "named 'transformers'"]


def damage(case, out_dir, tiny_dataset):
    """Spoil the checkpoint in out_dir (a copy of a good one) or what it points to."""
    path = os.path.join(out_dir, "ckpt.pt")
    if case == "random bytes":
        with open(path, "wb") as f:
            f.write(os.urandom(4096))
    elif case == "truncated":
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(data[:len(data) // 2])
    elif case == "no model":
        torch.save({"iter_num": 3}, path)
    elif case == "unbuildable model_args":
        checkpoint = torch.load(path, weights_only=False)
        checkpoint["model_args"].update(n_embd=30, n_head=4)
        torch.save(checkpoint, path)
    elif case == "another model's weights":
        checkpoint = torch.load(path, weights_only=False)
        checkpoint["model"]["transformer.h.0.mlp.c_fc.weight"] = torch.zeros(3, 3)
        torch.save(checkpoint, path)
    elif case == "non-finite weights":
        checkpoint = torch.load(path, weights_only=False)
        checkpoint["model"]["transformer.h.0.attn.c_proj.weight"][0, 0] = float("nan")
        torch.save(checkpoint, path)
    elif case in ("damaged meta.pkl", "meta.pkl of another vocabulary"):
        checkpoint = torch.load(path, weights_only=False)
        checkpoint["config"]["dataset"] = os.path.join(out_dir, "dataset")
        torch.save(checkpoint, path)
        os.makedirs(os.path.join(out_dir, "dataset"))
        with open(os.path.join(out_dir, "dataset", "meta.pkl"), "wb") as f:
            if case == "damaged meta.pkl":
                f.write(b"\x80\x04not a pickle")
            else:
                pickle.dump({"vocab_size": 3, "stoi": {"a": 0, "b": 1, "c": 2}, "itos": {0: "a", 1: "b", 2: "c"}}, f)


@pytest.mark.parametrize("case, words", [
    ("missing", "there is no checkpoint at"),
    ("random bytes", "cannot be read, it is damaged or not a checkpoint"),
    ("truncated", "cannot be read, it is damaged or not a checkpoint"),
    ("no model", "is not a training checkpoint"),
    ("unbuildable model_args", "has model_args this GPT cannot be built with"),
    ("another model's weights", "has shape (3, 3) in the checkpoint"),
    ("non-finite weights", "holds non-finite weights (NaN or inf in transformer.h.0.attn.c_proj.weight)"),
    ("damaged meta.pkl", "cannot be read as a character vocabulary"),
    ("meta.pkl of another vocabulary", "has 3 characters but the model's vocab_size is"),
])
def test_a_damaged_checkpoint_is_one_line_and_exit_2(case, words, char_checkpoint, tiny_dataset, tmp_path,
                                                      monkeypatch, capsys):
    out_dir = tmp_path / "out"
    if case != "missing":
        shutil.copytree(char_checkpoint[0], out_dir)
        damage(case, str(out_dir), tiny_dataset)
    code, out, err = sample_here(monkeypatch, capsys, f"--out_dir={out_dir}", *FLAGS)
    assert code == 2
    err = err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err


def test_a_damaged_checkpoint_from_the_command_line(char_checkpoint, tmp_path):
    shutil.copytree(char_checkpoint[0], tmp_path / "out")
    damage("truncated", str(tmp_path / "out"), None)
    p = subprocess.run([sys.executable, SAMPLE, f"--out_dir={tmp_path / 'out'}", *FLAGS], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 2 and "Traceback" not in p.stderr
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and "ckpt.pt cannot be read, it is damaged or not a checkpoint" in err[0]
