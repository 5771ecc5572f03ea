"""Pure passes over ``AdjointState`` and the combinators that compose them."""

from .combinators import Pass, StatefulPass, apply, compose, identity, init, is_stateful

__all__ = ["Pass", "StatefulPass", "apply", "compose", "identity", "init", "is_stateful"]
