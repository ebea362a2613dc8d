"""nanogns/layers/config.py: the classes in force, as the namedtuple the reference's model reads and as our
dict; the one table from train.py's layer flags to classes, which a new class reaches train.py, the
bench and the whole-model check through."""
import csv
import os

import pytest
import torch.nn as nn

import nanogns.layers.config as lc
from nanogns.layers.experts import Experts, PEGradNormExperts
from nanogns.layers import (PEGradNormEmbedding, PEGradNormLinear, PEGradNormSeparatedLayerNorm, PEGradNormSeparatedRMSNorm,
                      PEGradNormShimEmbedding, PEGradNormShimLinear)
from conftest import REPO, TINY
from fused_gns import PEGradNormFusedLayerNorm, PEGradNormFusedRMSNorm
from test_bench_throughput import TINY as BENCH_TINY, load_bench
from test_model_gns import check_gpt_against_brute_force
# autouse here too: check_gpt_against_brute_force caches its plain GPT's gradients, which must come
# from the one thread its own module runs on for its bit-for-bit comparison to hold in any order
from gns_fixtures import one_thread  # noqa: E402,F401
from test_train import train_until_exit

TORCH = dict(Embedding=nn.Embedding, Linear=nn.Linear, LayerNorm=nn.LayerNorm, RMSNorm=nn.RMSNorm, Experts=Experts)


class ReferenceStyleModel(nn.Module):
    """Written as the reference's model.py is: `lc.config.X(...)` read in __init__."""

    def __init__(self):
        super().__init__()
        self.wte = lc.config.Embedding(10, 8)
        self.ln = lc.config.LayerNorm(8, bias=False)
        self.fc = lc.config.Linear(8, 4)


class RMSNormModel(nn.Module):
    """A model whose normalisation is an RMSNorm, read from the config as the LayerNorm is."""

    def __init__(self):
        super().__init__()
        self.norm = lc.config.RMSNorm(8)
        self.fc = lc.config.Linear(8, 4)


def test_a_reference_style_model_gets_the_classes_in_force_then_torchs():
    with lc.set_contextual_config(Embedding=PEGradNormEmbedding, Linear=PEGradNormLinear,
                                  LayerNorm=PEGradNormSeparatedLayerNorm) as config:
        assert config is lc.config
        model = ReferenceStyleModel()
    assert type(model.wte) is PEGradNormEmbedding and type(model.fc) is PEGradNormLinear
    assert type(model.ln) is PEGradNormSeparatedLayerNorm and model.ln.bias is None
    plain = ReferenceStyleModel()
    assert (type(plain.wte), type(plain.ln), type(plain.fc)) == (nn.Embedding, nn.LayerNorm, nn.Linear)


def test_the_config_is_a_namedtuple_and_get_contextual_config_a_dict():
    assert lc.config._fields == ("Embedding", "Linear", "LayerNorm", "RMSNorm", "Experts")  # the reference's order, then ours
    assert lc.config._asdict() == TORCH and lc.get_contextual_config() == TORCH
    assert type(lc.get_contextual_config()) is dict
    # the reference's three classes still make a LayerClasses, RMSNorm torch's, Experts unmeasured
    assert lc.LayerClasses(nn.Embedding, nn.Linear, nn.LayerNorm).RMSNorm is nn.RMSNorm
    assert lc.LayerClasses(nn.Embedding, nn.Linear, nn.LayerNorm).Experts is Experts


def test_unspecified_classes_stay_as_they_were_and_each_level_is_restored():
    # the reference's set_contextual_config dropped the classes not named: its inner config
    # would have no Linear
    with lc.set_contextual_config(Linear=PEGradNormLinear):
        with lc.set_contextual_config(LayerNorm=PEGradNormFusedLayerNorm, Embedding=None) as inner:
            assert inner == (nn.Embedding, PEGradNormLinear, PEGradNormFusedLayerNorm, nn.RMSNorm, Experts)
            assert lc.get_contextual_config() == dict(TORCH, Linear=PEGradNormLinear, LayerNorm=PEGradNormFusedLayerNorm)
            with lc.set_contextual_config(RMSNorm=PEGradNormSeparatedRMSNorm):
                assert lc.config.RMSNorm is PEGradNormSeparatedRMSNorm
                assert type(RMSNormModel().norm) is PEGradNormSeparatedRMSNorm
            assert lc.config.RMSNorm is nn.RMSNorm
        assert lc.config == (nn.Embedding, PEGradNormLinear, nn.LayerNorm, nn.RMSNorm, Experts)
    assert lc.config._asdict() == TORCH


def test_restored_after_an_error_and_unknown_kinds_refused():
    with pytest.raises(KeyError):
        with lc.set_contextual_config(Linear=PEGradNormLinear):
            raise KeyError("inside")
    assert lc.config.Linear is nn.Linear
    with pytest.raises(ValueError, match="unknown layer kind"):
        with lc.set_contextual_config(Conv=nn.Conv1d):
            pass


def test_init_contextual_config_goes_back_to_torchs_classes():
    with lc.set_contextual_config(Linear=PEGradNormLinear, RMSNorm=PEGradNormFusedRMSNorm):
        lc.init_contextual_config()
        assert lc.config._asdict() == TORCH
        with lc.set_contextual_config(Embedding=PEGradNormEmbedding):
            assert lc.config.Embedding is PEGradNormEmbedding
    assert lc.config._asdict() == TORCH


# --------------------------------------------------------------------------------------------
# The one table from train.py's layer flags to classes

def test_the_table_keeps_train_pys_values_and_gives_set_contextual_configs_arguments():
    assert lc.classes_for_flags() == TORCH  # a flag not given is nn
    kept = {("linearclass", "gns"): PEGradNormLinear, ("linearclass", "shim"): PEGradNormShimLinear,
            ("embeddingclass", "gns"): PEGradNormEmbedding, ("embeddingclass", "shim"): PEGradNormShimEmbedding}
    for (flag, value), cls in kept.items():
        assert lc.FLAG_CLASSES[flag][value] is cls  # a one-kind flag's entry is the class itself
        experts = PEGradNormExperts if flag == "linearclass" else Experts  # measured with the Linears
        assert lc.classes_for_flags(**{flag: value}) == dict(TORCH, **{lc.FLAG_KINDS[flag]: cls}, Experts=experts)
    with lc.set_contextual_config(**lc.classes_for_flags(linearclass="shim", lnclass="fused")):
        model = ReferenceStyleModel()
    assert (type(model.wte), type(model.ln), type(model.fc)) == (nn.Embedding, PEGradNormFusedLayerNorm,
                                                                 PEGradNormShimLinear)


def test_lnclass_chooses_the_class_of_either_normalisation():
    """--lnclass's values keep their names and give a class for LayerNorm and one for RMSNorm, so the
    flag works whichever normalisation the model uses."""
    assert lc.flag_kinds("lnclass") == ("LayerNorm", "RMSNorm") and lc.flag_kinds("linearclass") == ("Linear",)
    both = {"nn": (nn.LayerNorm, nn.RMSNorm), "shim": (PEGradNormSeparatedLayerNorm, PEGradNormSeparatedRMSNorm),
            "fused": (PEGradNormFusedLayerNorm, PEGradNormFusedRMSNorm)}
    assert tuple(lc.FLAG_CLASSES["lnclass"]) == tuple(both)  # train.py's choices, in order
    for value, (layernorm, rmsnorm) in both.items():
        assert lc.classes_for_flags(lnclass=value) == dict(TORCH, LayerNorm=layernorm, RMSNorm=rmsnorm)
        assert lc.classes_for_flags(lnclass=value, linearclass="gns")["Experts"] is PEGradNormExperts
        with lc.set_contextual_config(**lc.classes_for_flags(lnclass=value, linearclass="shim")):
            layer_norm_model, rms_model = ReferenceStyleModel(), RMSNormModel()
        assert type(layer_norm_model.ln) is layernorm and type(rms_model.norm) is rmsnorm
        assert type(rms_model.fc) is PEGradNormShimLinear


def test_an_lnclass_entry_without_a_class_for_each_normalisation_is_one_line(monkeypatch):
    monkeypatch.setitem(lc.FLAG_CLASSES["lnclass"], "half", dict(LayerNorm=PEGradNormSeparatedLayerNorm))
    monkeypatch.setitem(lc.FLAG_CLASSES["lnclass"], "bare", PEGradNormSeparatedRMSNorm)
    for value in ("half", "bare"):
        with pytest.raises(ValueError) as error:
            lc.classes_for_flags(lnclass=value)
        message = f"FLAG_CLASSES['lnclass'][{value!r}] must give a class for each of LayerNorm, RMSNorm"
        assert message in str(error.value)
        assert "\n" not in str(error.value)
    monkeypatch.setitem(lc.FLAG_CLASSES["lnclass"], "both", dict(LayerNorm=PEGradNormSeparatedLayerNorm,
                                                                 RMSNorm=PEGradNormFusedRMSNorm))
    assert lc.classes_for_flags(lnclass="both")["RMSNorm"] is PEGradNormFusedRMSNorm  # one entry: a new value


@pytest.mark.parametrize("flags, message", [
    (dict(lnclass="gns"), "--lnclass='gns' is not one of nn, shim, fused"),
    (dict(normclass="nn"), "unknown layer flag(s) ['normclass']"),
])
def test_a_value_or_flag_not_in_the_table_is_one_line(flags, message):
    with pytest.raises(ValueError) as error:
        lc.classes_for_flags(**flags)
    assert message in str(error.value) and "\n" not in str(error.value)


class ProbeLinear(PEGradNormShimLinear):
    """A layer class that exists only in these tests: a measured Linear that counts its instances."""
    built = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        ProbeLinear.built += 1


def register_probe(monkeypatch):
    """ProbeLinear registered as --linearclass=probe: one entry in the table, no other edit."""
    monkeypatch.setitem(lc.FLAG_CLASSES["linearclass"], "probe", ProbeLinear)
    monkeypatch.setattr(ProbeLinear, "built", 0)


@pytest.fixture
def probe_in_the_table(monkeypatch):
    register_probe(monkeypatch)


def test_a_class_added_to_the_table_is_a_train_py_flag(tiny_dataset, tmp_path, monkeypatch):
    run = [*TINY, f"--dataset={tiny_dataset}", f"--out_dir={tmp_path}", "--max_iters=1", "--linearclass=probe",
           "--embeddingclass=shim"]  # both sides of the tied weight measure
    code, err = train_until_exit(*run)
    assert code == 2 and "--linearclass='probe' is not one of nn, gns, shim" in err, err
    register_probe(monkeypatch)
    code, err = train_until_exit(*run)
    assert code == 0, err
    assert ProbeLinear.built == 2 * 4 + 1  # every Linear of the 2-block GPT: 4 per block and lm_head
    with open(tmp_path / "log.csv") as f:
        header = f.readline()
    assert "train/gns/transformer.h.1.mlp.c_fc.weight/norm" in header  # and they measure


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # vmap's, of the brute force
def test_a_class_added_to_the_table_passes_the_whole_model_check(probe_in_the_table):
    classes = lc.classes_for_flags(linearclass="probe", embeddingclass="shim", lnclass="shim")
    check_gpt_against_brute_force(classes, bias=True)
    assert ProbeLinear.built == 2 * 4 + 1


# in the bench's train.py processes: the same registration, made as Python starts
SITECUSTOMIZE = """
import sys
sys.path.insert(0, {root!r})
import nanogns.layers.config as layer_config
from nanogns.layers import PEGradNormShimLinear


class ProbeLinear(PEGradNormShimLinear):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        with open({marker!r}, "a") as f:
            f.write("built\\n")


layer_config.FLAG_CLASSES["linearclass"]["probe"] = ProbeLinear
"""


@pytest.mark.slow
def test_a_class_added_to_the_table_is_a_bench_setting(tmp_path, monkeypatch):
    site, marker, out = tmp_path / "site", tmp_path / "built", tmp_path / "bench.csv"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(root=REPO, marker=str(marker)))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert load_bench().main([*BENCH_TINY, "--settings", "linearclass=probe", "--csv", str(out), "--no_memory"]) == 0
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert [(r["setting"], r["flags"]) for r in rows] == [("nn", "(plain nn)"), ("nn-null", "(plain nn)"),
                                                          ("linearclass=probe", "--linearclass=probe")]
    assert marker.read_text() == "built\n" * (1 * 4 + 1)  # timed (not for memory), a 1-block GPT


def test_flag_table_is_derived_from_the_registry():
    from nanogns.layers import MEASURED_CLASSES
    assert lc.FLAG_CLASSES["linearclass"] == {"nn": nn.Linear, **MEASURED_CLASSES["linear"]}
    assert lc.FLAG_CLASSES["embeddingclass"] == {"nn": nn.Embedding, **MEASURED_CLASSES["embedding"]}
    assert list(lc.FLAG_CLASSES["lnclass"]) == ["nn", *MEASURED_CLASSES["layernorm"]] == ["nn", "shim", "fused"]
    for value in MEASURED_CLASSES["layernorm"]:
        assert lc.FLAG_CLASSES["lnclass"][value] == {"LayerNorm": MEASURED_CLASSES["layernorm"][value],
                                                     "RMSNorm": MEASURED_CLASSES["rmsnorm"][value]}
    # a new registry entry is a new flag value, with nothing else written
    try:
        MEASURED_CLASSES["linear"]["twin"] = MEASURED_CLASSES["linear"]["shim"]
        assert lc._flag_table(("Linear",))["twin"] is MEASURED_CLASSES["linear"]["shim"]
    finally:
        del MEASURED_CLASSES["linear"]["twin"]
