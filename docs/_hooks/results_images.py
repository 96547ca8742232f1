"""MkDocs hook: the benchmark plots in `benchmarks/results/*.png` become site files under `results/`.

The plots stay where the benchmarks write them; pages link them as `results/<name>.png`, and a link to a
plot that no benchmark wrote fails `mkdocs build --strict`.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).parents[2] / "benchmarks" / "results"


def on_files(files: Files, config, **kwargs) -> Files:
    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"results/{png.name}", abs_src_path=str(png)))
    return files
