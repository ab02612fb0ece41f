"""Test setup: 8 fake CPU devices, set before jax is imported anywhere."""

import os

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


import jax  # noqa: E402

assert len(jax.devices("cpu")) == 8, "tests need 8 fake CPU devices; jax was imported too early"


import optax  # noqa: E402
import pytest  # noqa: E402

DIGITS_STEPS = 300


def pytest_addoption(parser):
    parser.addoption(
        "--golden-strict",
        choices=("save", "check"),
        default=None,
        help="tests/test_golden.py bit for bit on this machine: 'save' its digests before a "
        "refactor, 'check' them after (the default compares within a tolerance)",
    )
    parser.addoption(
        "--golden-strict-file",
        default=".golden-strict.jsonl",
        help="where --golden-strict keeps this machine's digests (default: %(default)s)",
    )


def _fp16_compiles() -> bool:
    """Whether XLA:CPU here links float16 conversions. Capped at SSE4_2 (no F16C) it emits
    calls to compiler-rt's __extendhfsf2/__truncsfhf2 and fails to link them ("Failed to
    materialize symbols"): an XLA limitation, not ours."""
    try:
        f = jax.jit(lambda x: (x.astype(jax.numpy.float16) * 3).astype(x.dtype))
        f(jax.numpy.ones(4)).block_until_ready()
        return True
    except jax.errors.JaxRuntimeError:
        return False


FP16 = _fp16_compiles()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    # where XLA cannot link fp16 conversions (above), a test that fails on exactly that
    # link error is skipped, saying why; everywhere else it fails as usual
    outcome = yield
    exc = outcome.excinfo
    if not FP16 and exc and "Failed to materialize symbols" in str(exc[1]):
        outcome.force_exception(
            pytest.skip.Exception(
                "XLA:CPU here cannot link float16 conversions (--xla_cpu_max_isa below F16C)",
                _use_item_location=True,
            )
        )


def pytest_configure(config):
    # --golden-strict=save starts a fresh digests file (in the controller, not in each
    # xdist worker: the workers append to it)
    if config.getoption("--golden-strict") == "save" and not hasattr(config, "workerinput"):
        path = config.getoption("--golden-strict-file")
        if os.path.exists(path):
            os.remove(path)


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
