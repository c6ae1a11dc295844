"""Prints the Transformers releases CI loads saved variants with, one a line: the declared floor, the newest release
installed (the project's environment), and the latest patch of every minor release in between."""

import importlib.metadata
import json
import re
import subprocess
import sys


def release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def main() -> None:
    requirement = next(r for r in importlib.metadata.requires("hf-normswap") if r.startswith("transformers"))
    floor, newest = re.search(r">=\s*([\d.]+)", requirement).group(1), importlib.metadata.version("transformers")
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "transformers", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    published = [v for v in json.loads(listing.stdout)["versions"] if re.fullmatch(r"\d+\.\d+\.\d+", v)]
    latest_patch = {}
    for version in sorted(published, key=release):
        if release(floor)[:2] < release(version)[:2] < release(newest)[:2]:
            latest_patch[release(version)[:2]] = version
    for version in sorted({floor, newest, *latest_patch.values()}, key=release):
        print(version)


if __name__ == "__main__":
    main()
