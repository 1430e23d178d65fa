"""The benchmark suites of real layers, from the package (convgrad.cli.bench.layers) that `convgrad bench` runs.

Run ``python benchmarks/layers.py`` to print every suite: layer, network, configuration, GFLOP per gradient.
Time them with ``convgrad bench --suite default`` (see ``convgrad bench --help``).
"""

from __future__ import annotations

from convgrad.cli.bench.layers import SUITES, Layer, select

__all__ = ["SUITES", "Layer", "select"]


def main() -> None:
    for suite, layers in SUITES.items():
        print(f"suite {suite!r}: {len(layers)} layers (float64 subset: {sum(layer.float64 for layer in layers)})")
        for layer in layers:
            mark = " [float64]" if layer.float64 else ""
            print(f"  {layer.name:24s} {layer.network:18s} {layer.spec().describe()}  "
                  f"{layer.gflop():.2f} GFLOP/gradient{mark}")


if __name__ == "__main__":
    main()
