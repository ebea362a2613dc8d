"""nanogns/refusals.py: a refused reference name fails at once with its hint, however it is reached."""
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


def test_every_refusal_is_listed_in_refusals_py():
    """One home for the reference's names that are not kept: no other source of ours builds a refusal
    of its own, and every table a module or class asks for is there."""
    import os
    import re
    from nanogns import refusals
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    own, asked = [], []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("tests", "build", "__pycache__")]
        for name in files:
            path = os.path.join(folder, name)
            if not name.endswith(".py") or path == refusals.__file__:
                continue
            text = open(path).read()
            if re.search(r"\b(refuse_module_names|refused)\(|raise ReferenceNameError", text):
                own.append(os.path.relpath(path, root))
            asked += re.findall(r'module_refusals\("([\w-]+)"\)', text)
    assert own == []
    assert sorted(set(asked)) == sorted(refusals.MODULES)
