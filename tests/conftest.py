"""Test setup: 8 fake CPU devices, set before jax is imported anywhere."""

import os
import platform

# The suite is dominated by XLA:CPU compiles of small programs; LLVM's optimisation of
# the generated code is most of each compile and buys nothing at these sizes (the HLO,
# its collectives and the numerics are the same: no fast-math). 22% less time measured on
# the slowest tests. JAXCOMM_TEST_FULL_OPT=1 keeps XLA's defaults.
_FAST_COMPILE = (
    ""
    if os.environ.get("JAXCOMM_TEST_FULL_OPT")
    else " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
)
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8" + _FAST_COMPILE
).strip()
# JAX_PLATFORMS=cuda,cpu (or tpu,cpu) runs tests/test_accelerator.py on an accelerator
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _x86_with_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return platform.machine() == "x86_64" and " avx2" in f.read()
    except OSError:
        return False


# On the CPU, XLA hands LAPACK calls (jnp.linalg.qr: PowerSGD above rank 2) to the
# OpenBLAS that scipy ships, which picks its kernels for the CPU when it loads: an
# AVX-512 machine's QR differs from an AVX2 machine's in the last bits, and
# tests/test_golden.py holds bits. Wherever the CPU has AVX2, the tests use OpenBLAS's
# AVX2 kernels (set before anything loads OpenBLAS).
if _x86_with_avx2():
    os.environ.setdefault("OPENBLAS_CORETYPE", "Haswell")

import jax  # noqa: E402

assert len(jax.devices("cpu")) == 8, "tests need 8 fake CPU devices; jax was imported too early"


import optax  # noqa: E402
import pytest  # noqa: E402

DIGITS_STEPS = 300


@pytest.fixture(scope="session")
def digits_split():
    """scikit-learn's digits, standardised, dealt to 8 workers."""
    from experiments import digits

    return digits.load(8)


@pytest.fixture(scope="session")
def dense_accuracy(digits_split):
    """Test accuracy of dense all-reduce SGD (lr 0.5, 300 steps): the bar to match."""
    import jaxcomm
    from experiments import digits

    tx = optax.chain(jaxcomm.allreduce(axis_name="data"), optax.sgd(0.5))
    return digits.train(tx, steps=DIGITS_STEPS, split=digits_split).accuracy
