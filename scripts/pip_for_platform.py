"""``pip download`` for another platform and Python, with that platform's environment markers: what
``bash scripts/setup.sh --wheelhouse DIR --platform TAG --python X.Y`` runs.

    python scripts/pip_for_platform.py download --platform macosx_14_0_arm64 \\
        --python-version 3.12 --only-binary=:all: --dest DIR -r requirements.txt

pip's ``--platform`` and ``--python-version`` choose which wheels fit the target, but pip evaluates
the environment markers of every requirement (``platform_system == "Linux"``,
``python_version < "3.12"``) for the machine it runs on (pypa/pip#11664, open). Run on Linux for
macOS, it then asks for torch's Linux-only CUDA dependencies (``cuda-bindings``, ``nvidia-*``),
which have no macOS wheels, and leaves out macOS-only ones (``appnope`` for ipykernel). This runs
pip itself, with the markers derived from those two options (as pex does for its ``--platform``):
``os_name``, ``sys_platform``, ``platform_system`` and ``platform_machine`` from the platform tag,
``python_version`` and ``python_full_version`` from the version; ``platform_release`` and
``platform_version`` say nothing about another machine and are left empty.
"""

from __future__ import annotations

import re
import sys

from pip._internal.cli.main import main as pip_main
from pip._vendor.packaging import markers

# platform tag prefix -> (os_name, sys_platform, platform_system)
SYSTEMS = {
    "manylinux": ("posix", "linux", "Linux"),
    "musllinux": ("posix", "linux", "Linux"),
    "linux": ("posix", "linux", "Linux"),
    "macosx": ("posix", "darwin", "Darwin"),
    "win": ("nt", "win32", "Windows"),
}
# a Linux or macOS tag: its name and version, then the architecture (group 1)
ARCH = re.compile(r"(?:many|musl)?linux(?:_\d+_\d+|\d+)?_(.+)$|macosx_\d+_\d+_(.+)$")
# the machine names Windows reports (platform.machine()) for its wheel tags
WINDOWS_MACHINES = {"win_amd64": "AMD64", "win_arm64": "ARM64", "win32": "x86"}


def target_environment(platform: str, python: str) -> dict[str, str]:
    """The PEP 508 marker values of CPython ``python`` (e.g. "3.12") on the machine the wheel tag
    ``platform`` (e.g. "macosx_14_0_arm64", "manylinux_2_28_x86_64", "win_amd64") describes."""
    prefix = next((p for p in SYSTEMS if platform.startswith(p)), None)
    if prefix is None:
        raise ValueError(
            f"--platform {platform}: not a Linux, macOS or Windows wheel tag"
            " (e.g. manylinux_2_28_x86_64, macosx_14_0_arm64, win_amd64)"
        )
    os_name, sys_platform, system = SYSTEMS[prefix]
    if prefix == "win":
        machine = WINDOWS_MACHINES.get(platform, "AMD64")
    else:  # the architecture after the tag's name and version: manylinux_2_28_x86_64 -> x86_64
        match = ARCH.match(platform)
        machine = match.group(1) or match.group(2)
        machine = "arm64" if machine == "universal2" else machine
    full = python if python.count(".") == 2 else f"{python}.0"
    return {
        "os_name": os_name,
        "sys_platform": sys_platform,
        "platform_system": system,
        "platform_machine": machine,
        "platform_release": "",
        "platform_version": "",
        "python_version": ".".join(full.split(".")[:2]),
        "python_full_version": full,
        "implementation_version": full,
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
    }


def _option(argv: list[str], name: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` (the first one) in ``argv``."""
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def main(argv: list[str]) -> int:
    platform = _option(argv, "--platform")
    python = _option(argv, "--python-version")
    if platform is not None and python is not None:
        target = target_environment(platform, python)
        host = markers.default_environment
        markers.default_environment = lambda: {**host(), **target}
    return pip_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
