import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedserve.services.text.stop_strings import StopStringMatcher


def run(matcher, pieces):
    out, stopped = [], False
    for piece in pieces:
        text, stopped = matcher.push(piece)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(matcher.flush())
    return "".join(out), stopped


def reference(text, stop, include):
    """The first stop string to complete, char by char; ties: the one starting earliest."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stop if end >= len(s) and text[end - len(s):end] == s]
        if starts:
            return text[:end if include else min(starts)], True
    return text, False


def test_stop_split_across_pushes():
    matcher = StopStringMatcher(["STOP"], include_stop_str_in_output=False)
    assert matcher.push("hello S") == ("hello ", False)
    assert matcher.held_text == "S"
    assert matcher.push("TO") == ("", False)
    assert matcher.push("P and more") == ("", True)
    assert matcher.is_stopped
    assert matcher.push("later") == ("", True)


def test_include_stop_str_in_output():
    matcher = StopStringMatcher(["STOP"], include_stop_str_in_output=True)
    assert run(matcher, ["ab ST", "OP cd"]) == ("ab STOP", True)


def test_held_text_released_when_it_stops_matching():
    matcher = StopStringMatcher(["STOP"], include_stop_str_in_output=False)
    assert matcher.push("a ST") == ("a ", False)
    assert matcher.push("ART") == ("START", False)


def test_no_false_holds():
    matcher = StopStringMatcher(["\n\n", "User:"], include_stop_str_in_output=False)
    assert matcher.push("plain text without any prefix") == ("plain text without any prefix", False)
    assert matcher.held_text == ""


def test_overlapping_prefixes_hold_the_longest_candidate():
    # "aab": after "xaa" both "aa" (a prefix of "aab") and "a" could start the stop
    matcher = StopStringMatcher(["aab"], include_stop_str_in_output=False)
    assert matcher.push("xaa") == ("x", False)
    assert matcher.push("a") == ("a", False)  # "aaa": only the last "aa" may still match
    assert matcher.push("b!") == ("", True)


def test_flush_releases_held_text_when_sequence_ends():
    matcher = StopStringMatcher(["</answer>"], include_stop_str_in_output=False)
    assert matcher.push("42 </ans") == ("42 ", False)
    assert matcher.flush() == "</ans"


def test_first_completed_stop_wins():
    matcher = StopStringMatcher(["abcd", "bc"], include_stop_str_in_output=True)
    assert run(matcher, ["xabcd"]) == ("xabc", True)
    matcher = StopStringMatcher(["b", "ab"], include_stop_str_in_output=False)
    assert run(matcher, ["xab"]) == ("x", True)  # both end at 'b': the earlier start wins


def test_no_stop_strings_passes_everything():
    matcher = StopStringMatcher([], include_stop_str_in_output=False)
    assert matcher.push("anything") == ("anything", False)
    assert matcher.flush() == ""


def test_empty_stop_string_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["ok", ""], include_stop_str_in_output=False)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="ab c\n", max_size=40),
       stop=st.lists(st.text(alphabet="ab c\n", min_size=1, max_size=4), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=10), include=st.booleans())
def test_any_split_matches_reference(text, stop, cuts, include):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    matcher = StopStringMatcher(stop, include_stop_str_in_output=include)
    assert run(matcher, pieces) == reference(text, stop, include)
