"""The classes and functions a pickle names, read from its opcodes without running it.

``pickletools.genops`` walks the opcode stream (it decodes arguments, it never imports or
calls anything): ``GLOBAL`` / ``INST`` carry ``"module name"``; ``STACK_GLOBAL`` (protocol 4+)
takes the last two strings pushed. Used to name what ``torch.load(weights_only=True)`` refuses in
a byte item (a tensor subclass such as torchao's float8 training tensors) in the refusal itself.
"""

from __future__ import annotations

import pickletools

__all__ = ["TENSOR_SUBCLASS_HINTS", "pickle_globals"]

#: Qualified-name prefixes of known ``torch.Tensor`` subclasses that training code leaves in state dicts.
TENSOR_SUBCLASS_HINTS = ("torchao.", "torch.distributed.tensor.", "torch._subclasses.", "float8_experimental.")

_STRINGS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING", "STRING"}


def pickle_globals(data: bytes, limit: int = 8) -> list[str]:
    """Up to ``limit`` distinct ``module.name`` globals ``data`` (one pickle) refers to, in order of appearance.

    A stream that does not decode ends the walk (the names found until then are returned).
    """
    found: list[str] = []
    last: list[str] = []
    try:
        for op, arg, _ in pickletools.genops(data):
            name = None
            if op.name in ("GLOBAL", "INST") and isinstance(arg, str):
                name = arg.replace(" ", ".", 1)
            elif op.name == "STACK_GLOBAL" and len(last) >= 2:
                name = f"{last[-2]}.{last[-1]}"
            elif op.name in _STRINGS and isinstance(arg, (str, bytes)):
                last = [*last[-1:], arg if isinstance(arg, str) else arg.decode("latin-1")]
            if name is not None and name not in found:
                found.append(name[:200])
                if len(found) >= limit:
                    break
    except (ValueError, EOFError, UnicodeDecodeError):
        pass
    return found
