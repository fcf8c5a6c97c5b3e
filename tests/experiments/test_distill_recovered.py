"""The distill study's 'quality recovered': a share of the teacher's gain over the unigram baseline,
undefined where the teacher gained nothing (a --quick run's teacher can be worse than the unigram,
and the ratio then printed nonsense: a better fine-tuned loss showed a smaller share)."""
from lintrans.experiments.distill import recovered


def test_recovered_is_the_share_of_the_teachers_gain():
    assert recovered(3.0, 2.0, 2.5) == 50.0 and recovered(3.0, 2.0, 2.0) == 100.0
    assert recovered(3.0, 2.0, 3.5) == -50.0  # worse than the unigram: a negative share, still defined


def test_recovered_is_undefined_without_a_gain_or_with_a_diverged_run():
    assert recovered(3.2, 3.5, 3.0) is None and recovered(3.2, 3.2, 3.0) is None
    assert recovered(3.0, 2.0, None) is None and recovered(3.0, float("nan"), 2.5) is None
