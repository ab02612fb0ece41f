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


# --- what `pytest -q` leaves to `pytest -q -m slow` -----------------------------------
# Tests that take minutes in all, each marked slow here in one list (CI runs both sets):
# processes (gloo, shaped links, kill -9), long training runs, notebooks in full mode
# (tests/test_notebooks.py marks those), benches and the PyTorch side-by-side.
SLOW_MODULES = {
    "test_distributed.py",  # real processes, kill -9 and resume
    "test_advise.py",  # times every method's step beside the no-exchange step
    "test_compare.py",  # the main job's runs
    "test_convergence.py",
    "test_convergence_quant.py",
    "test_step_parts.py",
    "test_bench.py",
    "test_peers.py",  # PyTorch DDP beside jaxcomm, in processes
    "test_torch_lm.py",  # the LM's GPT in PyTorch (torch is installed for the slow run)
    "test_netlab.py",  # shaped links in network namespaces
}
SLOW_TESTS = {
    "test_parallel.py": {
        "test_two_processes_helper_equals_hand_written_and_restores_bit_exactly",
        "test_a_long_loop_without_blocking_completes",
    },
    "test_train.py": {
        "test_one_step",
        "test_resume_equals_uninterrupted",
        "test_auto_records_its_choice_and_a_resumed_run_replays_it",
        "test_damaged_newest_checkpoint_falls_back_to_previous",
        "test_checkpoint_round_trip_bit_exact",
    },
    "test_policy.py": {"test_the_default_candidates_run_and_dense_is_among_them"},
    # a whole training loop saved and restored (37 s); test_train's and the examples'
    # checkpoint round trips run in pytest -q -m slow as well
    "test_core.py": {"test_checkpoint_restores_bit_exactly"},
    # the golden harness tested on itself (strict mode, the tolerant comparison): 35 s
    "test_golden.py": {
        "test_strict_mode_names_only_the_transform_whose_bits_changed",
        "test_the_tolerant_comparison_fails_on_a_real_change_and_only_there",
    },
    "test_two_phase.py": {"test_two_phase_emits_one_operand_per_collective_for_a_63_leaf_tree"},
    "test_sparse.py": {
        "test_strided_best_finds_first_maximum_and_runner_up_of_each_residue_class",
        "test_threshold_usage_adds_the_residual_and_skips_dense_leaves",
        "test_threshold_sends_nine_tenths_of_the_true_topk_on_structured_gradients",
    },
    "test_notebooks.py": {"test_notebook_executes"},  # quick and full mode: minutes
    "test_examples.py": {
        "test_the_example_learns",
        "test_the_nnx_example_restores_from_orbax_bit_exactly",
        "test_the_compressor_state_is_per_worker",
        "test_the_nnx_examples_batch_norm_statistics_are_equal_on_every_device",
    },
    "test_buckets.py": {
        "test_buckets_are_written_as_words_in_place",
        "test_all_gather_bucket_round_trips_mixed_dtypes",
        "test_a_payload_larger_than_a_bucket_is_not_copied_into_one",
        "test_small_leaves_riding_in_two_phase_are_the_mean",
        "test_small_leaves_riding_equal_their_all_reduce",
    },
    "test_dgc.py": {
        "test_when_more_pass_than_fit_the_largest_are_kept",
        "test_convergence_on_digits_at_999_sparsity_within_one_point_of_momentum_sgd",
        "test_tied_magnitudes_still_fill_the_payload_and_rotate",
        "test_masking_zeroes_u_and_v_at_sent_positions",
    },
    "test_flax.py": {"test_batch_stats_per_worker_average_to_the_mean_mode"},
    "test_topology.py": {
        "test_hierarchical_buckets_are_bit_identical_to_per_leaf",
        "test_hierarchical_inner_exchange_is_one_collective_per_bucket",
    },
    "test_sign.py": {
        "test_bf16_updates_keep_dtype_and_match_f32",
        "test_twobit_residual_invariant",
    },
    "test_powersgd.py": {
        "test_convergence_on_digits_within_one_point_of_sgd",
        "test_batched_equals_unbatched",
    },
    "test_sync.py": {"test_local_sgd_and_diloco_every_8_within_two_points_of_synchronous_sgd"},
    "test_optim.py": {"test_zero_one_adam_reaches_dense_adams_accuracy_on_digits"},
    "test_peers_report.py": {"test_each_configuration_builds_and_steps"},
    "test_harness_defects.py": {  # two real processes each (gloo), a minute or two each
        "test_sigterm_checkpoints_a_two_process_run_which_then_resumes",
        "test_the_survivor_of_a_dead_peer_exits_at_once_not_after_the_shutdown_barrier",
    },
}
# parametrized tests whose other cases are slow: these cases (`name`, else the case's
# id) stay in `pytest -q`
FAST_CASES = {
    "test_bucketed_updates_bit_identical_to_per_leaf": {"allreduce", "topk"},
    "test_a_gather_path_step_is_one_collective_small_leaves_included": {"cast"},
    "test_hlo_collective_count_equals_wire_count": {"allreduce"},
    "test_error_feedback_telescopes": {"topk", "ef_sign"},
    "test_shard_map_equals_pmap_equals_vmap": {"diloco", "local_sgd", "stale"},
    "test_all_gather_decode_any_worker_count": {"3"},
    "test_void_step_keeps_the_residual_bit_for_bit": {
        "float32-topk",
        "float32-threshold",
        "bfloat16-topk",
        "float32-randomk",
    },
    "test_default_moves_the_two_phase_bytes_on_8_workers_analytic_equals_hlo": {"int8", "ef_sign"},
    "test_sparsifier_matches_numpy_over_steps": {"topk"},
}
# The property tests over every registry entry (tests/test_registry.py's REGISTRY) run
# all of them under -m slow; `pytest -q` runs a few (dense, a cast, a sparsifier, a
# quantiser, a sign code, PowerSGD), the cheapest of their families to compile.
REGISTRY_SWEEPS = {"test_registry.py", "test_buckets.py", "test_parallel_checks.py"}
FAST_ENTRIES = {"allreduce", "cast", "topk", "int8:nearest_ef", "ef_sign", "powersgd"}


def _is_slow(item) -> bool:
    module = item.path.name
    if module in SLOW_MODULES or item.originalname in SLOW_TESTS.get(module, ()):
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    if item.originalname in FAST_CASES and params:
        case = params.get("name", item.callspec.id)
        return case not in FAST_CASES[item.originalname]
    return module in REGISTRY_SWEEPS and params.get("name", "allreduce") not in FAST_ENTRIES


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _is_slow(item):
            item.add_marker(pytest.mark.slow)


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
