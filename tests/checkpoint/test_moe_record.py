"""The model record with experts: a dense run matches a checkpoint written before
``model.moe`` existed; expert options are compared one by one; the record rebuilds them."""

from depthmix.checkpoint.record import mismatches, record, run_from_record
from depthmix.config.load import compose_run


def test_dense_runs_match_records_without_experts():
    run = compose_run("model=tiny")
    old = record(run)
    del old["model"]["moe"]  # a checkpoint from before model.moe
    assert mismatches(old, run) == []
    assert mismatches(record(compose_run("model=tiny", "model.moe=null")), run) == []


def test_expert_options_are_compared_one_by_one_and_rebuilt():
    moe = compose_run("model=tiny_moe")
    saved = record(moe)
    assert mismatches(saved, compose_run("model=tiny_moe", "model.moe.top_k=3")) == [
        "model.moe.top_k: checkpoint 2, this run 3"]
    assert "model.moe.num_experts: checkpoint 4, this run 0" in mismatches(
        saved, compose_run("model=tiny"))
    assert run_from_record(saved).model.moe == moe.model.moe
    # sequential and grouped experts hold the same weights: either loads the other's, and
    # the record's choice is the machine's that wrote it, resolved again where it is read
    grouped = compose_run("model=tiny_moe", "model.moe.experts_impl=grouped")
    assert mismatches(saved, grouped) == []
    assert run_from_record(record(grouped)).model.moe == moe.model.moe


def test_an_expert_option_given_to_eval_is_checked_against_the_checkpoint():
    from depthmix.evaluate.job import _requested

    saved = record(compose_run("model=tiny_moe"))
    asked = _requested(saved, compose_run("model=tiny_moe", "model.moe.top_k=3"),
                       {"model.moe.top_k"})
    assert mismatches(saved, asked) == ["model.moe.top_k: checkpoint 2, this run 3"]
