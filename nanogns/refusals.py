"""
The reference implementation's names that this fork does not keep (CerebrasResearch/nanoGNS,
exact/). Code written against the reference either runs here with the same meaning or, where
it uses one of these, fails at once with one line saying what to use instead: never with a
different number. Each module lists its own in one table at its end:

    __getattr__ = refuse_module_names(__name__, {"OldName": "use NewName(...) instead", ...})

and a class refuses an attribute or method with `old_name = refused("Class.old_name", "use ...")`.
"""


class ReferenceNameError(ImportError):
    """A reference name not kept here; the message says what to use instead. An ImportError and
    not an AttributeError, so that `from module import name` shows the message (Python replaces
    an AttributeError raised there with its own) and nn.Module's __getattr__ does not swallow it."""


def _message(qualified_name, hint):
    return f"{qualified_name} is the reference implementation's and is not kept in this fork: {hint}"


def refuse_module_names(module_name, hints):
    """A module-level __getattr__ (PEP 562) refusing each name in `hints` with its hint."""
    def __getattr__(name):
        if name in hints:
            raise ReferenceNameError(_message(f"{module_name}.{name}", hints[name]))
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
    return __getattr__


def refused(qualified_name, hint):
    """A class attribute (read, called or assigned) that fails with the hint."""
    def fail(*_):
        raise ReferenceNameError(_message(qualified_name, hint))
    return property(fail, fail)
