"""bench/report.py: the machine line every recorded figure carries."""

import platform

from bench.report import machine

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
flags\t\t: fpu avx2 avx512f avx512bw
processor\t: 1
cpu family\t: 99
model name\t: another
"""


def test_machine_names_family_and_vector_width_of_the_first_processor():
    line = machine(CPUINFO)
    assert line.startswith(f"{platform.machine()}, ")
    assert line.endswith(", AMD EPYC (family 26 model 2, AVX-512)")
    avx2 = machine(CPUINFO.replace(" avx512f avx512bw", ""))
    assert avx2.endswith(", AMD EPYC (family 26 model 2, AVX2)")
    assert machine("").endswith(" cores")  # no /proc/cpuinfo: architecture and cores only
