"""reference_names.py: a refused reference name fails at once with its hint, however it is reached."""
import types

import pytest
import torch.nn as nn

from nanogns.refusals import ReferenceNameError, refuse_module_names, refused


def test_a_refused_module_name_says_what_to_use_on_import_and_on_access(monkeypatch):
    mod = types.ModuleType("somemod")
    mod.__getattr__ = refuse_module_names("somemod", {"Old": "use New(x) instead"})
    monkeypatch.setitem(__import__("sys").modules, "somemod", mod)
    with pytest.raises(ReferenceNameError, match=r"somemod\.Old is the reference implementation's .*use New\(x\) instead"):
        from somemod import Old  # noqa: F401
    with pytest.raises(ImportError, match="use New"):
        mod.Old
    # any other missing name is a plain AttributeError, so hasattr/getattr defaults still work
    assert not hasattr(mod, "Missing") and getattr(mod, "Missing", 3) == 3


def test_a_refused_attribute_of_an_nn_module_is_not_swallowed_by_its_getattr():
    class Layer(nn.Linear):
        old_buffer = refused("Layer.old_buffer", "use new_buffer")

    layer = Layer(2, 3)
    with pytest.raises(ReferenceNameError, match="Layer.old_buffer .* use new_buffer"):
        layer.old_buffer
    with pytest.raises(ReferenceNameError):
        layer.old_buffer = 1
    assert [n for n, _ in layer.named_parameters()] == ["weight", "bias"]
