"""Switches of scaled_matmul's tuning: whether it may time (``TUNE``), and the configurations of the native kernels
forced for the probes in dev/matmul/ and the tests (``WMMA_TILE``, ``WGMMA_BN``). The Triton matmul's own debug
switches are attributes of ``ampkernels.matmul.triton.scaled_matmul`` (``TMA_DESCRIPTORS``, ``DIRECT_LAUNCH``).

Set an attribute, then call ``ampkernels.matmul.clear_caches()``: it forgets what was chosen under the old values
(configs, ``"auto"``'s choices, launchers) and hands the native switches to the extension (:func:`apply`)::

    from ampkernels.matmul import clear_caches, tuning

    tuning.WGMMA_BN = 192
    clear_caches()

They are module attributes, not environment variables read per launch: the launchers read them where they are made
(Python) or as a process-wide setting (C++, one atomic load), never a variable lookup on the hot path. Only ``TUNE``
starts from the environment (``AMPKERNELS_TUNE``, a user setting: docs/backends.md), read once, when ampkernels is
imported.
"""

from __future__ import annotations

import os

from ampkernels import dispatch

#: Whether scaled_matmul may time: the Triton matmul's config tuning and ``"auto"``'s choice between backends. False:
#: fixed rules decide (reproducible choices, no tuning on the first call of a problem). Starts as
#: ``AMPKERNELS_TUNE`` says (``0``: False), read once, when ampkernels is imported; set it to override.
TUNE: bool = os.environ.get("AMPKERNELS_TUNE", "1") != "0"

#: The WMMA kernel's configurations (csrc/matmul/wmma.cu): ``"auto"`` chooses by waves of tiles.
WMMA_TILES = ("auto", "128x128x32w4", "128x128x64w4", "128x128x64w4db", "portable")
#: The configuration the WMMA kernel runs (one of :data:`WMMA_TILES`).
WMMA_TILE: str = "auto"

#: The tile widths of the wgmma kernels, 16-bit and FP8 (csrc/matmul/scaled_matmul.h).
WGMMA_WIDTHS = (128, 192, 256)
#: The tile width the wgmma kernels run (one of :data:`WGMMA_WIDTHS`); None: the launcher's choice per problem.
WGMMA_BN: int | None = None


def timing_enabled() -> bool:
    """:data:`TUNE`, checked: whether scaled_matmul may time (the Triton interpreter never does)."""
    if not isinstance(TUNE, bool):
        raise TypeError(f"ampkernels.matmul.tuning.TUNE: expected True or False, got {TUNE!r}")
    return TUNE


def native_switches() -> tuple[str, int]:
    """(:data:`WMMA_TILE`, :data:`WGMMA_BN` or 0 for None) as the extension takes them, checked: a ValueError names
    the attribute and the values it takes."""
    if WMMA_TILE not in WMMA_TILES:
        raise ValueError(
            f"ampkernels.matmul.tuning.WMMA_TILE: expected one of {', '.join(WMMA_TILES)}, got {WMMA_TILE!r}"
        )
    if WGMMA_BN is not None and (type(WGMMA_BN) is not int or WGMMA_BN not in WGMMA_WIDTHS):
        raise ValueError(
            "ampkernels.matmul.tuning.WGMMA_BN: expected None (the launcher's choice) or one of "
            f"{', '.join(map(str, WGMMA_WIDTHS))}, got {WGMMA_BN!r}"
        )
    return WMMA_TILE, WGMMA_BN or 0


def apply() -> None:
    """Hands :data:`WMMA_TILE` and :data:`WGMMA_BN` to the extension, which keeps them for every later launch of its
    kernels (a process-wide setting); nothing to do where it is not built. ``ampkernels.matmul.clear_caches()``
    calls it; call it directly after setting them when launching the native ops (``torch.ops.ampkernels.*``)
    yourself, as the probes in dev/matmul/ do."""
    wmma_tile, wgmma_bn = native_switches()
    native = dispatch.native()
    if native is not None:
        native._set_matmul_tuning(wmma_tile, wgmma_bn)
