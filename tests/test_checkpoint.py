"""checkpoint.py: reading other forks' checkpoints, resuming, building train.py's model, and
writing ckpt.pt only from finite weights."""
import os
import re
import shutil
from dataclasses import asdict

import numpy as np
import pytest
import torch
import torch.nn as nn

from gns_fixtures import LLAMA, one_thread  # noqa: F401  (one_thread: autouse)
from checkpoint import (CheckpointError, config_from_checkpoint, init_model, load_weights, read_checkpoint,
                        resume_model, save_training_state, write_checkpoint)
from model import GPT, GPTConfig

CFG = dict(block_size=16, vocab_size=65, n_layer=2, n_head=2, n_embd=32)


def test_load_weights_maps_the_references_and_nanogpts_keys_and_refuses_what_does_not_fit():
    torch.manual_seed(0)
    source = GPT(GPTConfig(**CFG, bias=False, spectral_c_attn=[1]))
    sd = source.state_dict()
    reference = {}
    for k, v in sd.items():
        k = k.replace(".attn.c_attn.weight", ".attn.c_attn.qkv.weight").replace(".ln_1.", ".ln_1.affine.")
        reference[k] = v
    reference["transformer.h.0.ln_1.affine.bias"] = torch.zeros(32)  # its bias=False separated LayerNorm
    reference["transformer.h.0.ln_1.affine.weight_upegsqnorm"] = torch.tensor([2.0, 8.0])
    reference["transformer.h.1.attn.c_attn.scale"] = torch.tensor(1.1)  # its spectral Q/K/V scale
    reference["transformer.h.0.attn.bias"] = torch.ones(1, 1, 16, 16)  # nanoGPT's causal mask (torch < 2)
    target = GPT(GPTConfig(**CFG, bias=False, spectral_c_attn=[1]))
    notes = load_weights(target, {"_orig_mod." + k: v for k, v in reference.items()})
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in sd.items())
    assert any("renamed" in n for n in notes)
    # nanoGPT's checkpoints count no tokens: the caller's count is used, and said so
    notes = load_weights(target, {k: v for k, v in sd.items() if k != "tokens_processed"}, tokens_processed=640)
    assert target.tokens_processed.item() == 640 and any("no tokens_processed" in n for n in notes)
    # a non-zero bias has no place in a bias=False model, a weight of another shape or a key of another model neither
    for bad, words in [({**sd, "transformer.h.0.ln_1.bias": torch.ones(32)}, "transformer.h.0.ln_1.bias"),
                       ({**sd, "transformer.wpe.weight": torch.zeros(8, 32)}, "has shape (8, 32)"),
                       ({k: v for k, v in sd.items() if k != "lm_head.weight"}, "lacks lm_head.weight"),
                       ({**sd, "transformer.h.0.mlp.gate.weight": torch.zeros(3)}, "mlp.gate.weight")]:
        with pytest.raises(CheckpointError, match=re.escape(words)):
            load_weights(GPT(GPTConfig(**CFG, bias=False, spectral_c_attn=[1])), bad)


def test_weights_that_are_not_finite_are_refused_as_the_checkpoints_fault():
    # resumed, they would make every step non-finite, and the run would stop blaming the learning rate
    torch.manual_seed(0)
    sd = GPT(GPTConfig(**CFG)).state_dict()
    target = GPT(GPTConfig(**CFG))
    before = {k: v.clone() for k, v in target.state_dict().items()}
    for value in (float("nan"), float("inf")):
        bad = {**sd, "transformer.h.1.mlp.c_fc.weight": sd["transformer.h.1.mlp.c_fc.weight"].clone()}
        bad["transformer.h.1.mlp.c_fc.weight"][3, 5] = value
        with pytest.raises(CheckpointError, match=re.escape("the checkpoint holds non-finite weights (NaN or inf in "
                                                            "transformer.h.1.mlp.c_fc.weight): it is damaged")):
            load_weights(target, bad)
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in before.items())  # left as it was


# --------------------------------------------------------------------------------------------
# Llama-style options: norm, mlp, pos_emb, tie_embeddings

# --------------------------------------------------------------------------------------------
# Llama-style checkpoints

def save_run(model, path, model_args):
    """A checkpoint as train.py writes it (the fields resume_model reads)."""
    config = dict(gradient_accumulation_steps=1, batch_size=4, block_size=16)
    write_checkpoint({'model': model.state_dict(), 'model_args': model_args, 'iter_num': 3, 'config': config}, path)


def test_a_llama_style_checkpoint_round_trips(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG, bias=False, **LLAMA))
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)  # untied: the two matrices differ, and each must come back
    model_args = asdict(model.config)
    path = str(tmp_path / 'ckpt.pt')
    save_run(model, path, model_args)
    idx = torch.randint(0, 65, (2, 16))
    checkpoint = read_checkpoint(path)
    # sample.py's way: the config from model_args, then the weights
    loaded = GPT(config_from_checkpoint(checkpoint['model_args']))
    load_weights(loaded, checkpoint['model'])
    assert loaded.config == model.config
    torch.testing.assert_close(loaded(idx, idx)[1], model(idx, idx)[1], rtol=0, atol=0)
    # train.py's resume: the checkpoint's architecture, whatever the run's flags say
    run_args = dict(asdict(GPTConfig(**CFG)), norm='layernorm', mlp='gelu', pos_emb='learned', tie_embeddings=True)
    resumed, _ = resume_model(path, run_args, config={})
    assert {k: run_args[k] for k in LLAMA} == LLAMA
    assert all(torch.equal(v, resumed.state_dict()[k]) for k, v in model.state_dict().items())


def test_an_older_checkpoint_resumes_as_gpt2_whatever_the_flags_say(tmp_path):
    """A checkpoint without the new model_args holds GPT-2's layout: with bias=False its LayerNorm
    gains would fit an RMSNorm model's keys, so the run's --norm=rmsnorm must not be taken."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG, bias=False))
    old_args = {k: v for k, v in asdict(model.config).items() if k not in LLAMA}
    path = str(tmp_path / 'ckpt.pt')
    save_run(model, path, old_args)
    assert config_from_checkpoint(old_args) == model.config
    run_args = dict(asdict(GPTConfig(**CFG, bias=False)), **{**LLAMA, 'tie_embeddings': True})
    resumed, _ = resume_model(path, run_args, config={})
    assert {k: run_args[k] for k in LLAMA} == {k: getattr(GPTConfig, k) for k in LLAMA}
    assert type(resumed.transformer.ln_f) is nn.LayerNorm
    idx = torch.randint(0, 65, (2, 16))
    torch.testing.assert_close(resumed(idx, idx)[1], model(idx, idx)[1], rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# train.py's model and checkpoint

def test_init_model_builds_resumes_and_crops(tmp_path, capsys):
    run_args = dict(GPTConfig(**CFG).__dict__, dropout=0.0)
    torch.manual_seed(0)
    model, checkpoint = init_model('scratch', dict(run_args), {'block_size': 16}, str(tmp_path))
    assert checkpoint is None and model.config == GPTConfig(**run_args)
    save_run(model, str(tmp_path / 'ckpt.pt'), dict(run_args))
    # resume: the checkpoint's architecture and weights, cropped to the run's shorter block
    asked = dict(run_args, n_layer=5, block_size=8)
    resumed, checkpoint = init_model('resume', asked, {'block_size': 8}, str(tmp_path))
    assert checkpoint['iter_num'] == 3 and asked['n_layer'] == 2 and asked['block_size'] == 8
    assert resumed.config.block_size == 8 and resumed.transformer.wpe.weight.shape == (8, 32)
    assert torch.equal(resumed.transformer.wte.weight, model.transformer.wte.weight)
    with pytest.raises(CheckpointError, match="there is no checkpoint at"):
        init_model('resume', dict(run_args), {'block_size': 16}, str(tmp_path / 'elsewhere'))
    assert "Resuming training from" in capsys.readouterr().out


def test_save_training_state_writes_only_finite_weights_and_only_from_the_writer(tmp_path, capsys):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
    path = str(tmp_path / 'ckpt.pt')
    assert save_training_state(path, model, optimizer, {'iter_num': 7}, writer=False) is False
    assert not (tmp_path / 'ckpt.pt').exists()
    assert save_training_state(path, model, optimizer, {'iter_num': 7, 'model_args': asdict(model.config)}) is True
    saved = read_checkpoint(path)
    assert saved['iter_num'] == 7 and set(saved['optimizer']) == {'state', 'param_groups'}
    assert all(torch.equal(v, saved['model'][k]) for k, v in model.state_dict().items())
    assert f"saving checkpoint to {tmp_path}" in capsys.readouterr().out
    # a diverged model does not replace the good checkpoint
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight[0, 0] = float('nan')
    assert save_training_state(path, model, optimizer, {'iter_num': 8, 'model_args': asdict(model.config)}) is False
    assert read_checkpoint(path)['iter_num'] == 7 and sorted(p.name for p in tmp_path.iterdir()) == ['ckpt.pt']


def saved_training_state(path):
    """A small GPT's checkpoint as train.py writes it (save_training_state), after one AdamW step."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
    model(torch.randint(0, 65, (2, 16)), torch.randint(0, 65, (2, 16)))[1].backward()
    optimizer.step()
    assert save_training_state(path, model, optimizer, {'iter_num': 7, 'model_args': asdict(model.config),
                                                        'best_val_loss': 1.2345})
    return torch.load(path, weights_only=False)


def flipped(data, offset, count=64):
    """data with `count` bytes from `offset` on XORed with 0xFF."""
    return data[:offset] + bytes(b ^ 0xFF for b in data[offset:offset + count]) + data[offset + count:]


def test_a_checkpoint_damaged_in_its_tensors_or_values_is_refused(tmp_path):
    """torch.load does not compare the CRC-32s that torch.save writes beside each record: a file
    damaged in a tensor's bytes loaded, and a resume trained on from the damaged weights or moments."""
    import struct
    path = tmp_path / 'ckpt.pt'
    saved = saved_training_state(str(path))
    good = path.read_bytes()
    assert read_checkpoint(str(path))['iter_num'] == 7
    path.write_bytes(flipped(good, len(good) // 2))  # the middle of the file: some tensor's bytes
    with pytest.raises(CheckpointError, match=re.escape(f"{path} is damaged: its record data/") + r"\d+ " +
                       re.escape("(a tensor's bytes) does not match the CRC-32 saved with it")):
        read_checkpoint(str(path))
    # an optimizer moment (the run went NaN, and stopped blaming the learning rate)
    moment = max((s['exp_avg_sq'] for s in saved['optimizer']['state'].values()), key=torch.numel)
    path.write_bytes(flipped(good, good.index(moment.numpy().tobytes())))
    with pytest.raises(CheckpointError, match=re.escape("(a tensor's bytes) does not match")):
        read_checkpoint(str(path))
    # a value that is not a tensor: a float in data.pkl, which unpickles all the same
    value = good.index(struct.pack('>d', 1.2345))
    path.write_bytes(flipped(good, value + 6, 1))
    assert torch.load(path, weights_only=False)['best_val_loss'] != 1.2345
    with pytest.raises(CheckpointError, match=re.escape("its record data.pkl (the pickled values) does not match")):
        read_checkpoint(str(path))


@pytest.mark.parametrize("written", ["without CRC-32s", "in torch's legacy format"])
def test_a_checkpoint_with_nothing_to_compare_is_read_as_it_is(tmp_path, written):
    """Not damage: torch.save's CRC-32s switched off (every one is 0), or a file that is not a zip."""
    path = tmp_path / 'ckpt.pt'
    state = {'model': {'w': torch.ones(3)}, 'model_args': {k: 1 for k in ('n_layer', 'n_head', 'n_embd', 'block_size',
                                                                             'vocab_size')}}
    if written == "without CRC-32s":
        torch.serialization.set_crc32_options(False)
        try:
            torch.save(state, path)
        finally:
            torch.serialization.set_crc32_options(True)
    else:
        torch.save(state, path, _use_new_zipfile_serialization=False)
    assert torch.equal(read_checkpoint(str(path))['model']['w'], torch.ones(3))


def test_a_resume_trains_the_checkpoints_architecture_saying_so_and_refuses_another_block_size(tmp_path, capsys):
    torch.manual_seed(0)
    run_args = dict(GPTConfig(**CFG).__dict__, dropout=0.0)
    path = tmp_path / 'ckpt.pt'
    save_run(GPT(GPTConfig(**run_args)), str(path), dict(run_args))
    config = {'block_size': 16}
    # another value: the checkpoint's is used, as before; set in a file or on the command line, in one line each
    asked = dict(run_args, n_layer=5, n_embd=64, norm='rmsnorm', tie_embeddings=False)
    places = {'n_layer': ('the command line', 2), 'n_embd': ('config/x.py', 0), 'norm': ('the command line', 3)}
    capsys.readouterr()
    resumed, _ = init_model('resume', asked, config, str(tmp_path), places=places)
    assert resumed.config == GPTConfig(**run_args) and asked['n_layer'] == 2 and asked['tie_embeddings'] is True
    notes = [line for line in capsys.readouterr().out.splitlines() if "which this resume uses" in line]
    assert notes == [f"note: --n_layer=5 (set on the command line) is not {path}'s n_layer=2, which this resume uses: "
                     f"a resume trains the checkpoint's model as it is",
                     f"note: --n_embd=64 (set in config/x.py) is not {path}'s n_embd=32, which this resume uses: "
                     f"a resume trains the checkpoint's model as it is",
                     f"note: --norm=rmsnorm (set on the command line) is not {path}'s norm='layernorm', which this "
                     f"resume uses: a resume trains the checkpoint's model as it is"]  # tie_embeddings: not set
    # the block_size, set or not: it is also the batches' length; refused in one line before anything is built
    for value, where, said in [(32, ('the command line', 1), "--block_size=32 (set on the command line)"),
                               (8, ('config/x.py', 1), "--block_size=8 (set in config/x.py)"),
                               (1024, None, "--block_size=1024 (the default)")]:
        with pytest.raises(CheckpointError) as e:
            init_model('resume', dict(run_args, block_size=value), {'block_size': value}, str(tmp_path),
                       places={'block_size': where} if where else {})
        assert str(e.value) == (f"{said}, but {path} holds a model of block_size=16, and a resume trains it as it "
                                f"is, on batches of its block_size; nothing was changed: resume with --block_size=16, "
                                f"or train a model of --block_size={value} in another out_dir")


def test_model_args_are_the_flags_named_after_gptconfigs_fields_with_the_datasets_vocabulary():
    from checkpoint import model_args_for
    flags = dict(n_layer=2, n_head=2, n_embd=32, norm='rmsnorm', learning_rate=6e-4, out_dir='out')
    assert model_args_for(flags, 65) == dict(n_layer=2, n_head=2, n_embd=32, norm='rmsnorm', vocab_size=65)
    assert model_args_for(flags)['vocab_size'] == 50304  # GPT-2's 50257, padded


def test_the_run_state_saved_is_what_a_resume_reads_back():
    from checkpoint import resumed_counts, training_run_state

    class Controller:
        def state_dict(self):
            return {'accumulation': 3}
    scaler = torch.amp.GradScaler('cpu', enabled=False)
    order = torch.Generator().manual_seed(1).get_state()
    state = training_run_state(scaler, {'n_layer': 2}, {'seed': 1}, 7, 1.5, 2, order, [], Controller())
    assert list(state) == ['scaler', 'model_args', 'iter_num', 'best_val_loss', 'config', 'data_order',
                           'nonfinite_steps', 'dataset_fingerprint', 'gns_estimators', 'gns_groups',
                           'linear_norm_methods', 'bs_controller']
    assert state['dataset_fingerprint'] is None  # no --dataset in this config
    assert state['bs_controller'] == {'accumulation': 3} and torch.equal(state['data_order'], order)
    assert 'bs_controller' not in training_run_state(scaler, {}, {}, 7, 1.5, 2, order, [])
    assert resumed_counts(state) == (7, 1.5, 2)
    assert resumed_counts({'iter_num': 7, 'best_val_loss': 1.5}) == (7, 1.5, 0)  # nanoGPT's checkpoint
    assert resumed_counts(None) == (0, 1e9, 0)


def test_an_errors_sentence_is_cut_after_a_whole_word():
    from checkpoint import why
    long = RuntimeError("PytorchStreamReader failed reading zip archive: failed finding central directory " * 3 + "\nmore")
    text = why(long, 100)
    assert len(text) <= 104 and text.endswith(" ...") and str(long).startswith(text[:-4])
    assert text[:-4].split(" ")[-1] in str(long).split(" ")  # a whole word before the mark
    assert why(ValueError("short one\nsecond line")) == "short one" and why(KeyError()) == "KeyError"


def _adamw_after(steps, grads, fused):
    """A GPT's AdamW (model.configure_optimizers, fused or not) after `steps` steps on `grads`."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    optimizer = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95), 'cpu', fused=fused)
    for _ in range(steps):
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("nonfinite", [False, True])
def test_an_unfused_optimizers_state_loads_into_the_fused_step_and_steps_as_it_would_have(nonfinite):
    """nanoGPT's, the reference's and this project's older CPU checkpoints hold an AdamW whose param
    groups say fused=None: the resumed run keeps its own fused AdamW (which skips a non-finite step on
    the device) and takes the step the unfused one would have taken."""
    from checkpoint import load_optimizer_state
    from model import step_unless_nonfinite
    torch.manual_seed(1)
    grads = [torch.randn_like(p) for p in GPT(GPTConfig(**CFG)).parameters()]
    old_model, old_optimizer = _adamw_after(2, grads, fused=False)
    assert {g['fused'] for g in old_optimizer.state_dict()['param_groups']} == {None}
    checkpoint = {'optimizer': old_optimizer.state_dict()}
    model, optimizer = _adamw_after(0, grads, fused=True)
    model.load_state_dict(old_model.state_dict())
    load_optimizer_state(checkpoint, optimizer, torch.amp.GradScaler('cpu', enabled=False))
    assert all(g['fused'] for g in optimizer.param_groups)
    for m in (old_model, model):
        for p, g in zip(m.parameters(), grads):
            p.grad = g * (float('inf') if nonfinite else 1.0)
    before = [p.detach().clone() for p in model.parameters()]
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float('inf'))
    count = step_unless_nonfinite(optimizer, torch.amp.GradScaler('cpu', enabled=False), norm, 0)
    assert float(count) == float(nonfinite)
    if nonfinite:
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    else:
        old_optimizer.step()
        for p, q in zip(model.parameters(), old_model.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_a_float32_runs_checkpoint_resumes_in_float16_with_a_fresh_scaler():
    """--dtype=float16 on resume of a float32 run's checkpoint, whose disabled GradScaler saved an empty
    state: GradScaler.load_state_dict raised 'The source state dict is empty', a traceback."""
    from checkpoint import load_optimizer_state
    model, optimizer = _adamw_after(1, [torch.randn_like(p) for p in GPT(GPTConfig(**CFG)).parameters()], fused=True)
    checkpoint = {'optimizer': optimizer.state_dict(), 'scaler': torch.amp.GradScaler('cpu', enabled=False).state_dict()}
    scaler = torch.amp.GradScaler('cpu', init_scale=1024.0)
    load_optimizer_state(checkpoint, optimizer, scaler)
    assert scaler.get_scale() == 1024.0
    float16_run = torch.amp.GradScaler('cpu', init_scale=512.0).state_dict()
    load_optimizer_state({**checkpoint, 'scaler': float16_run}, optimizer, scaler)
    assert scaler.get_scale() == 512.0  # a float16 run's own scale goes on


def test_the_step_never_hands_found_inf_to_an_optimizer_that_cannot_take_it():
    """An optimizer whose loaded groups are not fused (whatever its defaults say) reads the norm instead."""
    from model import step_unless_nonfinite
    torch.manual_seed(1)
    grads = [torch.randn_like(p) for p in GPT(GPTConfig(**CFG)).parameters()]
    model, optimizer = _adamw_after(0, grads, fused=True)
    unfused = _adamw_after(1, grads, fused=False)[1].state_dict()
    optimizer.load_state_dict(unfused)  # torch's own load: the groups now say fused=None
    assert optimizer.defaults['fused'] and not optimizer.param_groups[0]['fused']
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float('inf'))
    step_unless_nonfinite(optimizer, torch.amp.GradScaler('cpu', enabled=False), norm, 0)  # raised before


# -- what tells one prepared dataset from another ---------------------------------------------------

def prepared(folder, train, val):
    """A dataset folder with these train and val tokens."""
    folder.mkdir(parents=True)
    np.asarray(train, dtype=np.uint16).tofile(folder / 'train.bin')
    np.asarray(val, dtype=np.uint16).tofile(folder / 'val.bin')
    return str(folder)


def datasets(tmp_path):
    """(data, the same data moved and renamed, its train tokens shuffled, its val tokens shuffled, a shorter
    train.bin): the shuffled ones of the very same sizes."""
    tokens = np.arange(20000) % 65
    shuffle = np.random.default_rng(0).permutation
    data = prepared(tmp_path / 'data', tokens, tokens[:2000])
    moved = str(shutil.copytree(data, tmp_path / 'elsewhere' / 'renamed'))
    train_shuffled = prepared(tmp_path / 'train_shuffled', shuffle(tokens), tokens[:2000])
    val_shuffled = prepared(tmp_path / 'val_shuffled', tokens, shuffle(tokens[:2000]))
    shorter = prepared(tmp_path / 'shorter', tokens[:-1], tokens[:2000])
    return data, moved, train_shuffled, val_shuffled, shorter


def test_a_datasets_fingerprint_tells_same_sized_content_apart_but_not_where_it_lies(tmp_path):
    from checkpoint import dataset_fingerprint
    data, moved, train_shuffled, val_shuffled, _ = datasets(tmp_path)
    assert dataset_fingerprint(moved) == dataset_fingerprint(data)
    assert dataset_fingerprint(train_shuffled) != dataset_fingerprint(data)
    assert dataset_fingerprint(val_shuffled) != dataset_fingerprint(data)
    assert dataset_fingerprint(str(tmp_path / 'missing')) is None


def read_bytes_so_far():
    """Bytes this process has read through read() calls (Linux's /proc/self/io rchar)."""
    with open('/proc/self/io') as f:
        return int(next(line for line in f if line.startswith('rchar:')).split()[1])


@pytest.mark.skipif(not os.path.exists('/proc/self/io'), reason="counts the bytes read with Linux's /proc/self/io")
def test_a_datasets_fingerprint_reads_a_few_mib_of_a_huge_file_and_sees_its_last_block(tmp_path):
    from checkpoint import dataset_fingerprint
    folder = tmp_path / 'huge'
    folder.mkdir()
    size = 20 << 30  # 20 GiB each, sparse: no room taken on the disk
    for split in ('train', 'val'):
        with open(folder / f'{split}.bin', 'wb') as f:
            f.truncate(size)
    before = read_bytes_so_far()
    fingerprint = dataset_fingerprint(str(folder))
    assert read_bytes_so_far() - before < 8 << 20
    with open(folder / 'train.bin', 'r+b') as f:  # the last token: in the last block compared
        f.seek(size - 2)
        f.write(b'\x01\x00')
    assert dataset_fingerprint(str(folder)) != fingerprint


def test_a_resume_compares_what_the_checkpoint_keeps_of_its_dataset(tmp_path):
    from checkpoint import check_same_dataset, dataset_fingerprint
    data, moved, train_shuffled, val_shuffled, shorter = datasets(tmp_path)
    checkpoint = {'config': {'dataset': data}, 'dataset_fingerprint': dataset_fingerprint(data)}
    check_same_dataset('out', checkpoint, moved)  # the same data elsewhere resumes
    for other, what in ((train_shuffled, "train.bin of the same size"), (val_shuffled, "val.bin of the same size"),
                        (shorter, "train.bin of 40,000 bytes, now 39,998")):
        with pytest.raises(CheckpointError) as refused:
            check_same_dataset('out', checkpoint, other)
        message = str(refused.value)
        assert len(message.splitlines()) == 1 and what in message, message
        assert f"out/ckpt.pt was trained on --dataset={data!r}, this run reads --dataset={other!r}" in message
    # a checkpoint that kept only the sizes (written before the content was compared) still resumes on what
    # it kept: the same sizes go on, another size stops
    sizes = {'config': {'dataset': data}, 'dataset_fingerprint': {'train_bytes': 40000, 'val_bytes': 4000}}
    check_same_dataset('out', sizes, train_shuffled)
    with pytest.raises(CheckpointError, match="train.bin of 40,000 bytes, now 39,998"):
        check_same_dataset('out', sizes, shorter)
    # and one older still, which kept nothing of it: by the folder's name
    check_same_dataset('out', {'config': {'dataset': data}}, str(tmp_path / 'data'))
    with pytest.raises(CheckpointError):
        check_same_dataset('out', {'config': {'dataset': data}}, moved)
