"""The weight-version rules of served engines, one test per rule (no vLLM, no HTTP: ``logra_pl.rollout.versions``)."""

from __future__ import annotations

import pytest

from logra_pl.rollout.versions import ExpectedVersions, VersionError, VersionLedger, base_version, run_version


def _loaded(version: str = "run/1") -> VersionLedger:
    """An engine that took the run's first full load."""
    ledger = VersionLedger.fresh("e1")
    assert ledger.admit_chunk("", version, 0, 1, full=True)
    ledger.begin(version)
    assert ledger.chunk_loaded(0)
    ledger.finish_load(version)
    return ledger


def _refused(call, *args) -> VersionError:
    with pytest.raises(VersionError) as info:
        call(*args)
    assert info.value.status == 409
    return info.value


def test_versions_are_named_by_engine_and_by_run() -> None:
    assert VersionLedger.fresh("abc").version == base_version("abc") == "base:abc"
    trainer = ExpectedVersions("run")
    assert trainer.never_synced and not trainer.current()
    assert trainer.next() == (None, run_version("run", 1)) == (None, "run/1")
    assert trainer.next() == ("run/1", "run/2")
    assert not trainer.never_synced and trainer.current() and trainer.seq == 2
    # Every rank counts the same changes, so every rank names the same versions without a message.
    ranks = [ExpectedVersions("run") for _ in range(3)]
    assert len({tuple(r.next() for _ in range(4)) for r in ranks}) == 1


def test_an_in_order_change_is_applied() -> None:
    ledger = _loaded("run/1")
    assert ledger.admit("run/1", "run/2")
    ledger.begin("run/2")
    assert ledger.version == "partial:run/2"  # an error inside the engine leaves a version no trainer expects
    ledger.commit("run/2")
    assert ledger.version == "run/2"


def test_a_change_after_a_skipped_update_is_refused() -> None:
    ledger = _loaded("run/1")
    err = _refused(ledger.admit, "run/2", "run/3")  # run/2 never arrived
    assert err.version == "run/1" and "an update was lost or the engine restarted" in str(err)
    assert ledger.version == "run/1"  # nothing applied
    _refused(VersionLedger.fresh("e2").admit, "run/1", "run/2")  # a restarted engine holds base:<id>


def test_a_repeat_whose_answer_was_lost_is_not_applied_twice() -> None:
    ledger = _loaded("run/1")
    assert ledger.admit("run/1", "run/2")
    ledger.begin("run/2")
    ledger.commit("run/2")
    assert ledger.admit("run/1", "run/2") is False  # answered applied: false
    assert ledger.admit_chunk("run/1", "run/2", 0, 3, full=False) is False  # a repeated load too
    assert ledger.version == "run/2" and ledger.loading is None


def test_a_full_load_repairs_from_any_version() -> None:
    for held in ("base:e1", "partial:run/4", "other-run/9"):
        ledger = VersionLedger(held)
        assert ledger.admit_chunk("run/2", "run/3", 0, 2, full=True)  # whatever the trainer thought it held
        ledger.begin("run/3")
        assert not ledger.chunk_loaded(0)
        assert ledger.admit_chunk("run/2", "run/3", 1, 2, full=True)
        assert ledger.chunk_loaded(1)
        ledger.finish_load("run/3")
        assert ledger.version == "run/3" and ledger.loading is None


def test_a_partial_load_must_name_the_engines_version() -> None:
    ledger = _loaded("run/1")
    _refused(ledger.admit_chunk, "run/0", "run/2", 0, 1, False)
    assert ledger.admit_chunk("run/1", "run/2", 0, 1, full=False)


def test_chunks_must_continue_the_open_transfer_in_order() -> None:
    ledger = _loaded("run/1")
    assert ledger.admit_chunk("run/1", "run/2", 0, 3, full=True)
    ledger.begin("run/2")
    ledger.chunk_loaded(0)
    err = _refused(ledger.admit_chunk, "run/1", "run/2", 2, 3, True)  # chunk 1 was lost
    assert "restart the transfer from chunk 0" in str(err)
    _refused(ledger.admit_chunk, "run/1", "run/9", 1, 3, True)  # another transfer's chunk
    assert ledger.admit_chunk("run/1", "run/2", 0, 3, full=True)  # restarting from chunk 0 is accepted


def test_a_change_without_its_new_version_is_malformed() -> None:
    ledger = _loaded()
    for call in (lambda: ledger.admit("run/1", None), lambda: ledger.admit_chunk("run/1", "", 0, 1, True)):
        with pytest.raises(VersionError) as info:
            call()
        assert info.value.status == 400 and "X-LoGRA-New-Version" in str(info.value)


def test_a_generate_naming_another_version_is_refused() -> None:
    ledger = _loaded("run/1")
    ledger.check_generate("run/1")
    ledger.check_generate(None)  # a request that names no version takes any weights
    err = _refused(ledger.check_generate, "run/2")
    assert err.version == "run/1" and "expects 'run/2'" in str(err)
    _refused(VersionLedger.fresh("e2").check_generate, "run/1")  # a restarted engine refuses


def test_the_trainer_marks_refusing_engines_stale_until_a_load() -> None:
    trainer = ExpectedVersions("run")
    trainer.next()
    trainer.refused("http://a")
    assert not trainer.current() and trainer.stale == {"http://a"}
    trainer.accepted("http://a")
    assert trainer.current()


def test_a_lost_update_is_detected_end_to_end() -> None:
    """The trainer's counter and an engine's ledger together: a payload that never arrived is never built on."""
    trainer, engine = ExpectedVersions("run"), VersionLedger.fresh("e1")
    prev, new = trainer.next()
    assert engine.admit_chunk(prev or "", new, 0, 1, full=True)
    engine.finish_load(new)
    trainer.next()  # update 2 is lost on the way
    prev, new = trainer.next()
    _refused(engine.admit, prev, new)  # update 3 would build on weights the engine does not hold
    trainer.refused("e1")
    _refused(engine.check_generate, trainer.expected)  # and nothing is sampled from them meanwhile
    prev, new = trainer.next()  # the repair: a full load from whatever the engine holds
    assert engine.admit_chunk(prev, new, 0, 1, full=True)
    engine.finish_load(new)
    trainer.accepted("e1")
    engine.check_generate(trainer.expected)
    assert trainer.current()


def test_asynchronous_waits_later_versions_may_arrive_and_changes_hold_for_served_requests() -> None:
    ledger = _loaded("run/3")
    assert ledger.may_arrive("run/4") and ledger.may_arrive("run/9")  # later versions of the held run
    assert not ledger.may_arrive("run/3") and not ledger.may_arrive("run/2")  # now, or the past: 409 at once
    assert not ledger.may_arrive("other/5") and not ledger.may_arrive(None)
    assert not VersionLedger.fresh("e2").may_arrive("run/4")  # a fresh engine needs a full load, not a wait
    # A change from run/3 that must let 2 requests at run/3 through first (two ranks' requests for one batch):
    assert ledger.holds("run/3", 2)
    ledger.admit_generate("run/3")
    assert ledger.holds("run/3", 2)
    ledger.admit_generate(None)  # expects any: served by run/3 as well
    assert not ledger.holds("run/3", 2) and not ledger.holds("run/3", 0)
    _refused(ledger.admit_generate, "run/4")  # not counted: refused
    assert ledger.served == 2
    assert not ledger.holds("run/2", 5)  # a change from another version does not wait: admit() judges it
    assert ledger.admit("run/3", "run/4")
    ledger.begin("run/4")
    ledger.commit("run/4")
    assert ledger.served == 0 and ledger.holds("run/4", 1)  # counts start again at the new version
