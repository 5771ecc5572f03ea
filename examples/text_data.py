"""A text corpus every Python has: the docstrings of the standard library, read with ``ast``
(no module is imported, so nothing runs), as byte-level token windows."""

from __future__ import annotations

import ast
import pathlib
import sysconfig

import torch

SKIP = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "turtledemo", "__pycache__"}


def stdlib_docstrings(max_bytes: int = 4_000_000) -> bytes:
    """Module, class and function docstrings of the standard library, in sorted file order."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.rglob("*.py")):
        if SKIP & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    chunks.append(doc.encode("utf-8", "replace"))
                    size += len(chunks[-1]) + 2
        if size >= max_bytes:
            break
    return b"\n\n".join(chunks)[:max_bytes]


def split_tokens(text: bytes, valid_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte tokens, cut into a training part and a held-out tail."""
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    cut = int(len(data) * (1 - valid_fraction))
    return data[:cut], data[cut:]


def batches(data: torch.Tensor, batch: int, seq: int, seed: int):
    """Endless ``(inputs, next-byte targets)`` windows at random offsets, from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        window = torch.stack([data[s : s + seq + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]
