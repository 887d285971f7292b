"""The lane-level emulation of the version-3 product (bench/gemv_emulator.py) on the CPU: the
index math of the kernel's tile decode, fragment layouts and work split, including the layout a
self-prepping decode product builds in its chunk slots, gives the reference product."""
from bench.gemv_emulator import emulate, emulate_sp


def test_self_prep_slots_give_the_reference_product():
    # error of the two int8 passes (~15 bits), not of the layout: a misplaced byte is ~1
    assert emulate_sp(4, 256, 256, nwarps=5) < 1e-3
    assert emulate_sp(3, 384, 256, nwarps=7) < 1e-3


def test_prep_kernel_layout_gives_the_reference_product():
    assert emulate(4, "mul1", "i8", 1, 256, 256, 5) < 1e-3
    assert emulate(4, "mcg", "f16", 1, 256, 256, 5) < 1e-6
