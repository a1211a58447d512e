"""The patch ledger on objects made here (no torch): every binding kind, exact LIFO restore."""

import types
import warnings

import pytest

from amp.patching import ORIGINAL_ATTRIBUTE, PatchLedger, is_amp_replacement


def module_function(x):
    return ("module", x)


class Base:
    def method(self, x):
        return ("method", x)

    @classmethod
    def class_method(cls, x):
        return ("class", cls.__name__, x)

    @staticmethod
    def static_method(x):
        return ("static", x)


class Child(Base):
    pass


def fake_module():
    module = types.ModuleType("fake")
    module.function = module_function
    return module


def wrapping(tag):
    """A replacement factory: calls through, tagging the result."""

    def make(original):
        def replacement(*args, **kwargs):
            return (tag, original(*args, **kwargs))

        setattr(replacement, ORIGINAL_ATTRIBUTE, original)
        return replacement

    return make


def test_module_function_is_patched_and_restored_by_identity():
    module = fake_module()
    ledger = PatchLedger()
    patch = ledger.patch(module, "function", wrapping("amp"))
    assert module.function(1) == ("amp", ("module", 1))
    assert is_amp_replacement(module.function) and patch.owned
    ledger.restore()
    assert module.function is module_function and len(ledger) == 0


def test_inherited_method_is_restored_without_a_shadow_attribute():
    ledger = PatchLedger()
    patch = ledger.patch(Child, "method", wrapping("amp"))
    assert not patch.owned
    assert Child().method(2) == ("amp", ("method", 2))
    assert Base().method(2) == ("method", 2)  # the base class is untouched
    ledger.restore()
    assert "method" not in vars(Child)
    assert Child.method is Base.method and Child().method(3) == ("method", 3)


@pytest.mark.parametrize("name", ["class_method", "static_method"])
def test_classmethods_and_staticmethods_keep_their_descriptor(name):
    original = vars(Base)[name]
    ledger = PatchLedger()
    ledger.patch(Base, name, lambda descriptor: descriptor)  # put the raw descriptor back in
    ledger.restore()
    assert vars(Base)[name] is original
    assert getattr(Child, name)(1)[-1] == 1
    if name == "class_method":
        assert Child.class_method(1) == ("class", "Child", 1)  # still bound to the subclass


def test_instance_attribute_patch_is_removed_again():
    instance = Child()
    ledger = PatchLedger()
    ledger.patch(instance, "method", wrapping("instance"))
    assert instance.method(4) == ("instance", ("method", 4))
    assert Child().method(4) == ("method", 4)
    ledger.restore()
    assert "method" not in vars(instance) and instance.method(5) == ("method", 5)


def test_restore_is_last_in_first_out_across_kinds():
    module = fake_module()
    order = []
    ledger = PatchLedger()
    ledger.patch(module, "function", wrapping("first"))
    ledger.add_undo("first undo", lambda: order.append("first"))
    ledger.add_undo("second undo", lambda: order.append("second"))
    ledger.restore()
    assert order == ["second", "first"] and module.function is module_function


def test_patching_an_amp_replacement_again_is_refused():
    module = fake_module()
    ledger = PatchLedger()
    ledger.patch(module, "function", wrapping("amp"))
    with pytest.raises(RuntimeError, match="already patched by amp"):
        PatchLedger().patch(module, "function", wrapping("again"))
    ledger.restore()


def test_someone_patching_on_top_is_left_alone_with_a_warning():
    module = fake_module()
    ledger = PatchLedger()
    ledger.patch(module, "function", wrapping("amp"))
    theirs = lambda x: ("theirs", x)  # noqa: E731
    module.function = theirs
    with pytest.warns(RuntimeWarning, match="replaced after amp patched it"):
        ledger.restore()
    assert module.function is theirs


def test_a_wrapper_that_wraps_ours_stays_silently():
    """An LR scheduler wraps optimizer.step after amp: its wrapper calls ours and may stay."""
    instance = Child()
    ledger = PatchLedger()
    patch = ledger.patch(
        instance, "method", lambda original: types.MethodType(Base.method, instance)
    )

    def wrapper(*args):
        return patch.replacement(*args)

    wrapper.__wrapped__ = Base.method
    instance.method = wrapper
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ledger.restore()
    assert instance.method is wrapper


def test_restore_tries_every_entry_and_reraises_the_first_error():
    module = fake_module()
    ledger = PatchLedger()
    ledger.patch(module, "function", wrapping("amp"))

    def fail():
        raise ValueError("undo failed")

    ledger.add_undo("failing", fail)
    with pytest.raises(ValueError, match="undo failed"):
        ledger.restore()
    assert module.function is module_function and len(ledger) == 0


def test_reapplying_a_recorded_patch_reuses_its_replacement():
    module = fake_module()
    ledger = PatchLedger()
    patch = ledger.patch(module, "function", wrapping("amp"))
    ledger.restore()
    again = PatchLedger()
    assert again.reapply_all([patch]) == []  # built against what is there: installed
    assert module.function is patch.replacement
    again.restore()
    module.function = lambda x: x  # torch changed underneath: the record no longer applies
    stale_ledger = PatchLedger()
    assert stale_ledger.reapply_all([patch]) == [patch] and len(stale_ledger) == 0
