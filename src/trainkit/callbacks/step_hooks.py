"""Which hooks of a callback Lightning calls at every training step, and how a callback of ours
declares the few it uses.

Lightning calls each of these hooks of every callback at every step, in a profiler context, even
where the hook is ``Callback``'s empty one: a few microseconds each, about 0.2 ms a step for the
template's callbacks on the small MLP, where a step takes 11 ms (docs/design.md, "What a step
costs"). Lightning skips a hook that is not callable, so ``step_hooks`` sets the ones a callback
does not use to None.
"""

from collections.abc import Callable

import lightning as L

STEP_HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_batch_end",
)


def step_hooks(*used: str) -> Callable[[type[L.Callback]], type[L.Callback]]:
    """Class decorator: the callback takes part in a training step only through ``used``; its
    other step hooks are set to None. Refuses a hook in ``used`` that the class does not define,
    and an unused one that it (or a parent other than ``Callback``) defines: nothing that works is
    dropped. A subclass that defines one of the dropped hooks gets it called again; one that also
    inherits from another callback class must define the step hooks it wants from that one, as
    the None here comes first in the method order."""
    unknown = sorted(set(used) - set(STEP_HOOKS))
    if unknown:
        raise ValueError(f"not step hooks: {unknown}; they are {list(STEP_HOOKS)}")

    def declare(cls: type[L.Callback]) -> type[L.Callback]:
        for name in STEP_HOOKS:
            defined = getattr(cls, name) not in (None, getattr(L.Callback, name))
            if name in used and not defined:
                raise TypeError(f"{cls.__name__} names {name} in step_hooks but does not define it")
            if name not in used:
                if defined:
                    raise TypeError(f"{cls.__name__} defines {name}: name it in step_hooks")
                setattr(cls, name, None)
        return cls

    return declare
