import pytest

from mrv2.utils import FlexibleArgumentParser
from mrv2.utils.argparse_utils import dashed_flag


def test_underscored_long_flags_parse_as_dashed():
    parser = FlexibleArgumentParser()
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--tokenizer-mode")
    parser.add_argument("-q")
    args = parser.parse_args(["--max_model_len", "8", "--tokenizer_mode=a_b", "-q", "x_y"])
    assert (args.max_model_len, args.tokenizer_mode, args.q) == (8, "a_b", "x_y")


def test_values_and_short_flags_are_left_alone():
    assert dashed_flag("some_value") == "some_value"
    assert dashed_flag("-O_x") == "-O_x"
    assert dashed_flag("--a_b=c_d") == "--a-b=c_d"


def test_an_unknown_flag_is_still_an_error():
    parser = FlexibleArgumentParser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--no_such_flag"])
