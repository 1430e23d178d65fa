"""The symbols explain's text and pictures use, each defined once; a view lists only those it shows."""

from __future__ import annotations

import re

__all__ = ["SYMBOLS", "used_symbols"]

# symbol -> (pattern that finds it in a text, definition)
SYMBOLS: dict[str, tuple[str, str]] = {
    "N": (r"\(N[,*]", "batch size"),
    "C_x": (r"C_x", "channels of the big side x: the input of a forward conv, the output of a transposed one"),
    "C_y": (r"C_y", "channels of the small side y: the output of a forward conv, the input of a transposed one"),
    "g": (r"/g\b|\bg\*", "groups"),
    "*i": (r"\*i\b", "the spatial size of the big side x"),
    "*o": (r"\*o\b", "the spatial size of the small side y"),
    "*k": (r"\*k\b", "the kernel size"),
    "T": (r"\bT\b", "the number of kernel taps, prod(k)"),
    "zero-insert": (r"zero-insert", "put stride-1 zeros between neighbouring entries, so a stride-1 conv sees them "
                                    "spaced as the strided forward wrote them"),
    "flip": (r"\bflip", "reverse the kernel in every spatial dim: the tap that met the first row now meets the last"),
    "phase rho": (r"phase|\brho\b", "phase rho (one index per dim) is the rows rho, rho+s, rho+2s, ... of the "
                                    "big side; each phase is a small stride-1 conv with only the kernel taps that "
                                    "reach it"),
    "depth to space": (r"depth to space", "the channels of phase rho become the rows rho::s of the result"),
    "space to depth": (r"space to depth", "blocks of d rows become channels: the rows phi::d of a block, for each "
                                          "phi < d, become one channel"),
    "im2col": (r"im2col", "copy the window each kernel tap reads, so the conv becomes one matrix multiplication"),
    "r": (r"\bleftover\b|\br=", "the leftover: trailing rows of the padded big side that no window reads"),
}


def used_symbols(text: str) -> list[tuple[str, str]]:
    """(symbol, definition) for every symbol the text uses, in SYMBOLS order."""
    return [(name, definition) for name, (pattern, definition) in SYMBOLS.items() if re.search(pattern, text)]
