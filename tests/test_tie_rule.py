"""`server_utils.same_greedy_or_tied`: equal ids pass, a parting passes only at a float-noise tie
where the other side took the runner-up."""
import pytest

from server_utils import same_greedy_or_tied


def _answer(ids, tops):
    return {"output_ids": ids, "meta_info": {"output_top_logprobs": tops}}


TOPS = [[[-0.1, 5, None], [-3.0, 6, None]], [[-1.00000, 7, None], [-1.00003, 8, None]]]


def test_equal_and_tied_pass():
    same_greedy_or_tied(_answer([5, 7], TOPS), _answer([5, 7], TOPS))
    same_greedy_or_tied(_answer([5, 7], TOPS), _answer([5, 8], TOPS))  # 3e-5 nat apart


@pytest.mark.parametrize("got", [[6, 7], [5, 9], [5]])
def test_parting_without_a_tie_fails(got):
    with pytest.raises(AssertionError):
        same_greedy_or_tied(_answer([5, 7], TOPS), _answer(got, TOPS))
