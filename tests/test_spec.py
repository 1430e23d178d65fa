"""ConvSpec: shape maths against torch's own shapes, and every validation error."""

from __future__ import annotations

import math

import pytest
import torch

from convgrad.spec import (
    ConvSpec,
    check_bias_sizes,
    check_output_mask,
    output_rows,
    pad_split,
    pad_then_crop,
    pad_to_rows,
    padded_sizes,
    phase_data_rows,
    same_padding,
    strided_crop,
    tap_rows,
)
from helpers import grid_cases, random_cases, reference_forward


@pytest.mark.parametrize("case", grid_cases() + random_cases(60, seed=7), ids=str)
def test_output_shape_matches_torch(case) -> None:
    spec = case.spec()
    x = torch.zeros(case.input_shape, dtype=torch.float64)
    w = torch.zeros(case.weight_shape, dtype=torch.float64)
    y = reference_forward(case, x, w, None)
    expected = spec.output_shape[1:] if spec.unbatched else spec.output_shape
    assert tuple(y.shape) == expected


@pytest.mark.parametrize("case", grid_cases(), ids=str)
def test_side_shapes_are_torchs_input_and_output_shapes(case) -> None:
    """x is the big side (forward: input; transposed: output), y the small one; batched, as backends see them."""
    spec = case.spec()
    x = torch.zeros(case.input_shape, dtype=torch.float64)
    y = reference_forward(case, x, torch.zeros(case.weight_shape, dtype=torch.float64), None)
    shapes = [(1, *s) if spec.unbatched else s for s in (tuple(x.shape), tuple(y.shape))]
    big, small = shapes[::-1] if spec.transposed else shapes
    assert (spec.x_shape, spec.y_shape) == (big, small)


@pytest.mark.parametrize("case", grid_cases() + random_cases(60, seed=8), ids=str)
def test_leftover_definition_and_bounds(case) -> None:
    spec = case.spec()
    for i, o, k, s, d, (lo, hi), r, op in zip(spec.x_size, spec.y_size, spec.kernel_size, spec.stride,
                                              spec.dilation, spec.padding, spec.leftover, spec.output_padding):
        assert (o - 1) * s + d * (k - 1) + 1 + r == i + lo + hi  # the last read row plus r unread rows
        assert 0 <= r < (s if not spec.transposed else max(s, d))
        if spec.transposed:
            assert r == op
    assert spec.transpose_padded_size == tuple(i + d * (k - 1) for i, k, d in
                                               zip(spec.x_size, spec.kernel_size, spec.dilation))


def test_stride_leaves_real_rows_unread() -> None:
    spec = ConvSpec.from_shapes((1, 1, 8, 8), (1, 1, 3, 3), stride=2)
    assert spec.leftover == (1, 1)
    assert spec.unread_input_rows == (1, 1)
    padded = ConvSpec.from_shapes((1, 1, 8, 8), (1, 1, 3, 3), stride=2, padding=1)
    assert padded.leftover == (1, 1) and padded.unread_input_rows == (0, 0)


@pytest.mark.filterwarnings("ignore:Using padding=.same. with even kernel")
@pytest.mark.parametrize("size", range(1, 12))
@pytest.mark.parametrize("k,s,d", [(1, 1, 1), (2, 1, 1), (3, 1, 2), (4, 1, 1), (3, 2, 1), (4, 3, 1), (2, 2, 3),
                                   (5, 4, 2)])
def test_same_padding_rule(size: int, k: int, s: int, d: int) -> None:
    lo, hi = same_padding(size, k, s, d)
    total = lo + hi
    assert hi - lo == total % 2  # asymmetric exactly when the total is odd, extra on the high side
    spec = ConvSpec.from_shapes((1, 1, size), (1, 1, k), stride=s, dilation=d, padding="same")
    assert spec.padding == ((lo, hi),)
    if d * (k - 1) + 1 <= size + total:
        assert spec.output_size == (math.ceil(size / s),)  # TF/JAX: out = ceil(in / stride)
    if s == 1:  # torch's own 'same' agrees for stride 1
        x, w = torch.randn(1, 1, size), torch.randn(1, 1, k)
        ours = torch.nn.functional.conv1d(torch.nn.functional.pad(x, (lo, hi)), w, dilation=d)
        torch.testing.assert_close(ours, torch.nn.functional.conv1d(x, w, padding="same", dilation=d))


def test_symbolic_sizes_stay_symbolic() -> None:
    """Under torch.export a dynamic dim's size is a torch.SymInt: from_shapes refused it ("input.shape=(s31, 2, 12,
    12) must contain only ints (got SymInt)", issue 40), and int() would fix it to the example's size. The spec now
    computes with it, and guards nothing for a batch, a stride-1 'same' dim or a transposed conv's dims."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    env = ShapeEnv()
    batch, size = (env.create_symintnode(env.create_symbol(hint, ConstantSource(name), dynamic_dim=DimDynamic.DYNAMIC),
                                         hint=hint) for name, hint in (("batch", 3), ("size", 12)))
    spec = ConvSpec.from_shapes((batch, 2, size, 9), (4, 2, 3, 4), stride=(1, 2), padding="same", memo=False)
    assert spec.batch is batch and spec.input_size[0] is size
    assert spec.padding == ((1, 1), (1, 2)) and spec.output_shape[1:] == (4, size, 5)
    t = ConvSpec.from_shapes((batch, 4, size, 9), (4, 2, 3, 4), stride=2, padding=1, transposed=True,
                             output_padding=1, memo=False)
    assert (t.output_shape[0], t.output_shape[2]) == (batch, 2 * size) and t.output_shape[3] == 19
    assert not env.guards
    with pytest.raises(TypeError, match=r"input\.shape=\(3, 2, 12\.0, 9\) must contain only ints \(got float\)"):
        ConvSpec.from_shapes((3, 2, 12.0, 9), (4, 2, 3, 4))


def test_specs_are_hashable_and_compare_by_value() -> None:
    a = ConvSpec.from_shapes((2, 4, 9, 9), (6, 2, 3, 3), stride=2, groups=2, fn="a")
    b = ConvSpec.from_shapes([2, 4, 9, 9], [6, 2, 3, 3], stride=(2, 2), padding=((0, 0), (0, 0)), groups=2, fn="b")
    assert a == b and hash(a) == hash(b)


def test_from_shapes_remembers_a_spec_but_still_checks_each_type() -> None:
    """A layer's spec is looked up by its arguments (no validation on every forward); an argument equal to a
    remembered one but of another type (1.0 or True for 1, a list for a tuple) is still validated."""
    a = ConvSpec.from_shapes((2, 4, 9, 9), (6, 4, 3, 3), 1, 1, 1, False, 0, 1, fn="memo")
    assert ConvSpec.from_shapes((2, 4, 9, 9), (6, 4, 3, 3), 1, 1, 1, False, 0, 1, fn="memo") is a
    for bad in (dict(stride=1.0), dict(stride=True), dict(groups=True), dict(padding=(1.0, 1))):
        args = dict(stride=1, padding=1, dilation=1, groups=1) | bad
        with pytest.raises(TypeError, match="memo: "):
            ConvSpec.from_shapes((2, 4, 9, 9), (6, 4, 3, 3), fn="memo", **args)
    with pytest.raises(TypeError, match="transposed=1 must be a bool"):
        ConvSpec.from_shapes((2, 4, 9, 9), (6, 4, 3, 3), 1, 1, 1, 1, 0, 1, fn="memo")
    assert ConvSpec.from_shapes([2, 4, 9, 9], [6, 4, 3, 3], [1, 1], [1, 1], fn="memo") == a  # lists: validated
    # tuples and (lo, hi) pairs: the memo key tests a tuple of ints by its types in C, pairs one by one
    pairs = ConvSpec.from_shapes((2, 4, 9, 9), (6, 4, 3, 3), (1, 1), ((1, 1), (1, 1)), fn="memo")
    assert ConvSpec.from_shapes((2, 4, 9, 9), (6, 4, 3, 3), (1, 1), ((1, 1), (1, 1)), fn="memo") is pairs
    for bad in (dict(stride=(1, True)), dict(stride=(1, 1.0)), dict(padding=((1, 1.0), (1, 1))),
                dict(padding=((1, True), (1, 1)))):
        args = dict(stride=(1, 1), padding=((1, 1), (1, 1))) | bad
        with pytest.raises(TypeError, match="memo: "):
            ConvSpec.from_shapes((2, 4, 9, 9), (6, 4, 3, 3), fn="memo", **args)
    assert ConvSpec.from_shapes((2, 4, 9, 9), (6, 4, 3, 3), 1, 1, fn="other").fn == "other"


def test_from_shapes_without_its_memo_validates_afresh_and_leaves_the_memo_alone() -> None:
    """memo=False (what torch.compile traces) neither reads nor fills the memo, and validates as with it."""
    from convgrad.spec.arguments import SPECS

    args = ((2, 4, 11, 11), (6, 4, 3, 3), 2, 1)
    SPECS.clear()
    fresh = ConvSpec.from_shapes(*args, fn="unmemoised", memo=False)
    assert not SPECS  # nothing remembered
    remembered = ConvSpec.from_shapes(*args, fn="unmemoised")
    assert remembered == fresh and len(SPECS) == 1
    again = ConvSpec.from_shapes(*args, fn="unmemoised", memo=False)
    assert again == remembered and again is not remembered  # not read from the memo
    with pytest.raises(TypeError, match="unmemoised: "):
        ConvSpec.from_shapes(*args[:2], stride=1.0, fn="unmemoised", memo=False)


def test_from_shapes_remembers_a_subclass_apart() -> None:
    """from_shapes builds cls: a subclass called with the arguments of a remembered ConvSpec gets its own class."""
    class Sub(ConvSpec):
        pass

    args = ((2, 4, 9, 9), (6, 4, 3, 3), 2, 1)
    assert type(ConvSpec.from_shapes(*args, fn="sub")) is ConvSpec
    assert type(Sub.from_shapes(*args, fn="sub")) is Sub
    assert type(Sub.from_shapes(*args, 2, fn="sub")) is Sub
    assert type(ConvSpec.from_shapes(*args, 2, fn="sub")) is ConvSpec


F = "conv_weight_grad"
BAD: list[tuple[dict, type, str]] = [
    (dict(stride=0), ValueError, r"conv_weight_grad: stride=0 must be positive"),
    (dict(stride=(1, -2)), ValueError, r"stride=\(1, -2\) must be positive"),
    (dict(dilation=0), ValueError, r"dilation=0 must be positive"),
    (dict(padding=-1), ValueError, r"padding=-1 must be >= 0"),
    (dict(padding=((1, -1), (0, 0))), ValueError, r"padding=.*must be >= 0"),
    (dict(stride=1.5), TypeError, r"stride=1.5 must be an int"),
    (dict(padding=(1.0, 1)), TypeError, r"padding=\(1.0, 1\) must contain only ints"),
    (dict(dilation=True), TypeError, r"dilation=True must be an int"),
    (dict(stride=(1, 1, 1)), ValueError, r"stride=\(1, 1, 1\) must have 1 or 2 entries"),
    (dict(padding=((1, 1),)), ValueError, r"padding=.*must have 2 \(lo, hi\) pairs"),
    (dict(padding="full"), ValueError, r"padding='full' must be an int, a tuple, 'same' or 'valid'"),
    (dict(groups=0), ValueError, r"groups=0 must be positive"),
    (dict(groups=2.0), TypeError, r"groups=2.0 must be an int"),
    (dict(groups=3), ValueError, r"groups=3 must divide in_channels=8"),
    (dict(weight=(6, 3, 3, 3), groups=2), ValueError, r"weight.shape=\(6, 3, 3, 3\) with groups=2 expects "
                                                      r"in_channels=6, but input has 8 channels"),
    (dict(weight=(5, 4, 3, 3), groups=2), ValueError, r"groups=2 must divide out_channels=5"),
    (dict(output_padding=1), ValueError, r"output_padding=\(1, 1\) is only allowed for a transposed"),
    (dict(weight=(6, 8, 9, 3)), ValueError, r"kernel extent dilation\*\(k-1\)\+1=9 is larger than the padded "
                                            r"input 7\+0\+0=7 in spatial dim 0"),
    (dict(weight=(6, 8, 3, 3), dilation=4), ValueError, r"kernel extent dilation\*\(k-1\)\+1=9 is larger"),
    (dict(weight=(6, 8, 3)), ValueError, r"input.shape=\(2, 8, 7, 7\) must have 3 dims"),
    (dict(weight=(6, 8)), ValueError, r"weight.shape=\(6, 8\) must have 3, 4 or 5 dims"),
    (dict(input=(2, 8, 0, 7)), ValueError, r"input.shape=\(2, 8, 0, 7\) has an empty spatial dim"),
    (dict(weight=(6, 8, 0, 3)), ValueError, r"weight.shape=\(6, 8, 0, 3\) has an empty kernel"),
    (dict(transposed="yes"), TypeError, r"transposed='yes' must be a bool"),
]


@pytest.mark.parametrize("kwargs,exc,match", BAD, ids=[m for _, _, m in BAD])
def test_invalid_arguments_raise_named_errors(kwargs: dict, exc: type, match: str) -> None:
    kwargs = dict(kwargs)
    input_shape = kwargs.pop("input", (2, 8, 7, 7))
    weight_shape = kwargs.pop("weight", (6, 8, 3, 3))
    with pytest.raises(exc, match=match):
        ConvSpec.from_shapes(input_shape, weight_shape, fn=F, **kwargs)


TRANSPOSED_BAD: list[tuple[dict, str]] = [
    (dict(padding="same"), r"padding='same' is not defined for a transposed convolution"),
    (dict(output_padding=2, stride=2), r"output_padding=\(2, 2\) must be smaller than max\(stride, dilation\)"),
    (dict(output_padding=(0, 3), stride=2, dilation=3), r"output_padding=\(0, 3\) must be smaller"),
    (dict(padding=5), r"output size \(-5, -5\) must be positive"),
    (dict(weight=(4, 3, 3, 3)), r"expects in_channels=4 for a transposed conv, but input has 8 channels"),
]


@pytest.mark.parametrize("kwargs,match", TRANSPOSED_BAD, ids=[m for _, m in TRANSPOSED_BAD])
def test_invalid_transposed_arguments(kwargs: dict, match: str) -> None:
    kwargs = dict(kwargs)
    weight_shape = kwargs.pop("weight", (8, 3, 3, 3))
    with pytest.raises(ValueError, match=match):
        ConvSpec.from_shapes((2, 8, 3, 3), weight_shape, transposed=True, fn="conv_transpose", **kwargs)


def test_output_padding_up_to_dilation_is_allowed() -> None:
    spec = ConvSpec.from_shapes((1, 2, 3), (2, 1, 3), stride=2, dilation=3, output_padding=2, transposed=True)
    assert spec.leftover == (2,) and spec.output_size == (2 * 2 + 3 * 2 + 1 + 2,)


@pytest.mark.parametrize("bias_sizes", [[5], (7,), [6, 1], "6", 6])
def test_bias_sizes_must_be_none_or_out_channels(bias_sizes) -> None:
    with pytest.raises(ValueError, match=r"conv_backward: bias_sizes=.* must be None or \[out_channels\]=\[6\]"):
        check_bias_sizes("conv_backward", bias_sizes, 6)
    check_bias_sizes("conv_backward", None, 6)
    check_bias_sizes("conv_backward", [6], 6)


@pytest.mark.parametrize("mask", [(True, True), (True, True, True, True), (1, 0, 1), "TTT", None])
def test_output_mask_must_be_three_bools(mask) -> None:
    with pytest.raises(ValueError, match=r"conv_backward: output_mask=.* must be three bools"):
        check_output_mask("conv_backward", mask)


def test_spec_imports_no_torch() -> None:
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None; import convgrad.spec as s; "
            "print(s.ConvSpec.from_shapes((1, 2, 5), (3, 2, 3), stride=2).output_shape)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "(1, 3, 2)"


def test_with_batch_in_groups_folds_the_samples_into_group_blocks() -> None:
    """Per-sample weight gradients as one grouped conv's: sample n's channels are group block n."""
    spec = ConvSpec.from_shapes((3, 4, 9, 8), (6, 2, 3, 2), stride=2, padding=((1, 0), (0, 1)), groups=2)
    folded = spec.with_batch_in_groups()
    assert (folded.batch, folded.in_channels, folded.out_channels, folded.groups) == (1, 12, 18, 6)
    assert folded.weight_shape == (18, 2, 3, 2) and folded.output_size == spec.output_size
    x, gy = torch.randn(spec.input_shape, dtype=torch.float64), torch.randn(spec.output_shape, dtype=torch.float64)
    per_sample = [torch.nn.grad.conv2d_weight(torch.nn.functional.pad(x[n:n + 1], (0, 1, 1, 0)), spec.weight_shape,
                                              gy[n:n + 1], stride=2, groups=2) for n in range(3)]
    ref = torch.stack(per_sample).reshape(folded.weight_shape)
    got = torch.nn.grad.conv2d_weight(torch.nn.functional.pad(x.reshape(1, 12, 9, 8), (0, 1, 1, 0)),
                                      folded.weight_shape, gy.reshape(1, 18, *gy.shape[2:]), stride=2, groups=6)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="with_batch_in_groups needs batch >= 1, got batch=0"):
        spec.with_batch(0).with_batch_in_groups()


def test_with_batch_in_groups_of_one_sample_or_an_unbatched_input_is_a_batched_conv() -> None:
    for shape in ((1, 4, 9, 8), (4, 9, 8)):  # a batch of 1, and an unbatched input (its one sample)
        folded = ConvSpec.from_shapes(shape, (6, 2, 3, 2), groups=2).with_batch_in_groups()
        assert (folded.batch, folded.in_channels, folded.groups, folded.unbatched) == (1, 4, 2, False), shape
        assert folded.input_shape == (1, 4, 9, 8) and folded.output_shape == (1, 6, 7, 7), shape


def test_with_batch_refuses_a_negative_batch() -> None:
    spec = ConvSpec.from_shapes((2, 4, 9), (6, 4, 3), fn="conv_weight_grad")
    assert spec.with_batch(0).input_shape == (0, 4, 9) and spec.with_batch(2) is spec  # unchanged: itself
    with pytest.raises(ValueError, match="conv_weight_grad: batch=-1 must be >= 0"):
        spec.with_batch(-1)


@pytest.mark.parametrize("merge", [0, 3, 8])
def test_with_merged_groups_refuses_a_merge_that_does_not_divide_groups(merge: int) -> None:
    spec = ConvSpec.from_shapes((2, 8, 9), (8, 2, 3), groups=4, fn="regroup")
    assert spec.with_merged_groups(1) == spec and spec.with_merged_groups(2).groups == 2
    assert spec.with_merged_groups(4).weight_shape == (8, 8, 3)
    with pytest.raises(ValueError, match=f"regroup: merge={merge} must divide groups=4"):
        spec.with_merged_groups(merge)


def test_tap_rows_are_the_rows_that_read_data_by_brute_force() -> None:
    """Output row r reads data row r + offset + reach, which exists for 0 <= it < size: the rows that do are
    first..stop-1, the first of them reading row data_first."""
    for size in range(0, 5):
        for rows in range(0, 5):
            for offset in range(-4, 4):
                for reach in range(0, 4):
                    first, stop, data_first = tap_rows(size, rows, offset, reach)
                    reading = [r for r in range(rows) if 0 <= r + offset + reach < size]
                    assert list(range(first, stop)) == reading, (size, rows, offset, reach)
                    if reading:
                        assert data_first == reading[0] + offset + reach, (size, rows, offset, reach)


PAD_VALUES = range(-3, 4)


@pytest.mark.parametrize("lo", PAD_VALUES)
@pytest.mark.parametrize("hi", PAD_VALUES)
def test_pad_split_matches_the_builders_formula_and_pads_exactly(lo: int, hi: int) -> None:
    """pad_split replaced three copies (fwdconv.grad_input's _phase_conv and _subpixel_plan, grad_weight's _x_pads) of
    grow = max(lo, hi, 0), start = grow - max(lo, 0), crops = (min(lo, 0), min(hi, 0)); it must agree with that
    formula, and cropping by crops, padding grow on both sides and skipping start rows must give the rows padded
    by (lo, hi), followed only by surplus rows."""
    grow, start, crops, surplus = pad_split([(lo, hi), (hi, lo)])
    for (a, b), g, s, c, u in zip([(lo, hi), (hi, lo)], grow, start, crops, surplus):
        assert (g, s, c, u) == (max(a, b, 0), max(a, b, 0) - max(a, 0), (min(a, 0), min(b, 0)), g - max(b, 0))
        rows = torch.arange(1.0, 9.0)
        want = torch.nn.functional.pad(rows[max(-a, 0): len(rows) - max(-b, 0)], (max(a, 0), max(b, 0)))
        cropped = rows[-c[0]: len(rows) + c[1]]
        got = torch.nn.functional.pad(cropped, (g, g))[s:]
        assert torch.equal(got[: len(want)], want)
        assert len(got) - len(want) == g - max(b, 0)  # the surplus rows a conv's output never reads
        assert padded_sizes([len(rows)], [(a, b)]) == (len(want),)


@pytest.mark.parametrize("lo", PAD_VALUES)
@pytest.mark.parametrize("hi", PAD_VALUES)
def test_pad_split_conv_rows_and_offset_match_the_phase_convs_old_formula(lo: int, hi: int) -> None:
    """PadSplit.conv_rows and .offset replaced fwdconv.grad_input._phase_conv's inline rows + start + grow - max(hi, 0)
    and start - grow; they must agree with that formula and be the output extent of a stride-1 conv (dilation
    1..2, 1..3 taps) of the cropped rows padded by grow, whose rows start..start+rows-1 are the wanted ones."""
    split = pad_split([(lo, hi), (hi, lo)])
    for rows in range(0, 6):
        old = tuple(rows + b + p - max(h, 0) for b, p, (_, h) in zip(split.start, split.grow, [(lo, hi), (hi, lo)]))
        assert split.conv_rows((rows, rows)) == old
    assert split.offset == tuple(b - q for b, q in zip(split.start, split.grow)) == (-max(lo, 0), -max(hi, 0))
    for size in range(4, 9):
        for taps in range(1, 4):
            for dil in (1, 2):
                wanted = output_rows(size, taps, 1, dil, (lo, hi))
                cropped = padded_sizes([size], [split.crops[0]])[0]
                if wanted < 0 or cropped < 0:
                    continue
                got = output_rows(cropped, taps, 1, dil, (split.grow[0], split.grow[0]))
                assert split.conv_rows((wanted, 0))[0] == got, (size, taps, dil)


def test_strided_crop_matches_the_weight_plans_old_formula_and_keeps_the_wanted_rows() -> None:
    """strided_crop replaced fwdconv.grad_weight._x_pads' inline (-(e // d), -(m - e // d - k)): over a grid it must
    agree, and cropping range(rows) by it must leave the k rows after the first e/d."""
    for step in range(1, 4):
        for start in range(0, 3 * step + 1, step):
            for rows in range(0, 9):
                for wanted in range(0, rows - start // step + 1):
                    lo, hi = strided_crop(start, step, rows, wanted)
                    assert (lo, hi) == (-(start // step), -(rows - start // step - wanted))
                    kept = list(range(rows))[-lo: rows + hi]
                    assert kept == list(range(start // step, start // step + wanted)), (start, step, rows, wanted)


def test_pad_to_rows_matches_the_blocks_and_stride_phase_old_formulas_and_makes_rows() -> None:
    """pad_to_rows replaced fwdconv.grad_weight._blocks_plan's inline (lo, hi + u*d - size) and (0, m*d - o), and
    stride_phase's (lo, hi + s*U - size): over a grid it must agree, keep lo, and pad a dim of size - lo - hi rows
    to exactly rows rows."""
    for lo in range(-2, 3):
        for hi in range(-2, 3):
            for raw in range(3, 7):
                padded = raw + lo + hi
                for rows in range(max(padded - 2, 0), padded + 5):
                    got = pad_to_rows((lo, hi), padded, rows)
                    assert got == (lo, hi + rows - padded)
                    assert got[0] == lo and padded_sizes([raw], [got]) == (rows,), (lo, hi, raw, rows)


def test_phase_data_rows_match_stride_to_depths_old_formula_and_brute_force() -> None:
    """phase_data_rows replaced fwdconv.grad_weight.StrideToDepth._rows' inline m0, h0, count: over a grid it must
    agree with that formula and with brute force (phase row m is x row s*m + rho - lo when 0 <= it < size)."""
    for s in range(1, 4):
        for rho in range(s):
            for lo in range(-3, 4):
                for size in range(0, 7):
                    for rows in range(0, 6):
                        first, count, data_first = phase_data_rows(size, rows, s, rho, lo)
                        m0 = max(0, -((rho - lo) // s))
                        h0 = s * m0 + rho - lo
                        assert (first, count, data_first) == (m0, max(0, min(rows - m0, len(range(h0, size, s)))), h0)
                        inside = [m for m in range(rows) if 0 <= s * m + rho - lo < size]
                        assert list(range(first, first + count)) == inside, (s, rho, lo, size, rows)
                        if inside:
                            assert data_first == s * first + rho - lo


@pytest.mark.parametrize("lo", PAD_VALUES)
@pytest.mark.parametrize("hi", PAD_VALUES)
def test_pad_then_crop_pads_by_lo_and_hi_even_where_f_pad_would_fail(lo: int, hi: int) -> None:
    """pad_then_crop replaced the positive/negative parts written out in tensor_ops.pad, numpy's _pad and
    fwdconv.plan.pad_code: padding by its first part, then removing its second, is row m = x[m - lo] (zero outside
    x) for every m < i + lo + hi, including a crop (-3, 3) of 2 rows that only the padding makes room for."""
    rows = torch.arange(1.0, 3.0)  # 2 rows
    (grow,), (cut,) = pad_then_crop([(lo, hi)])
    assert min(grow + cut) >= 0 and grow[0] - cut[0] == lo and grow[1] - cut[1] == hi
    padded = torch.nn.functional.pad(rows, grow)
    got = padded[cut[0]: max(len(padded) - cut[1], 0)]  # a stop below 0 would wrap; crop that far: empty
    want = [float(rows[m - lo]) if 0 <= m - lo < len(rows) else 0.0 for m in range(max(len(rows) + lo + hi, 0))]
    assert got.tolist() == want


@pytest.mark.parametrize("transposed", [False, True])
def test_derived_values_computed_once_match_their_formulas_and_follow_replace(transposed: bool) -> None:
    """The values every call reads (shapes, sizes, the aten arguments, the padding split) are computed once per
    spec (issue 25, item 11); each equals its formula from the fields, also on specs derived by ``replace``
    (with_batch, with_merged_groups, with_leading_unit_dim). Mutant: ``_output_shape`` built from ``y_size`` for
    a transposed conv fails it."""
    from convgrad.spec.formulation import output_rows, transposed_output_rows
    w = (4, 3, 3, 2) if transposed else (6, 2, 3, 2)
    base = ConvSpec.from_shapes((2, 4, 9, 8), w, (2, 1), ((1, 2), (0, 0)), (1, 2), transposed,
                                (1, 0) if transposed else 0, 2)
    for spec in (base, base.with_batch(5), base.with_merged_groups(2), base.with_leading_unit_dim()):
        rows = [transposed_output_rows(o, k, s, d, op, p) if transposed else output_rows(o, k, s, d, p)
                for o, k, s, d, op, p in zip(spec.input_size, spec.kernel_size, spec.stride, spec.dilation,
                                             spec.output_padding, spec.padding)]
        out = tuple(rows)
        assert spec.output_size == out and (spec.x_size, spec.y_size) == ((out, spec.input_size) if transposed
                                                                           else (spec.input_size, out))
        assert spec.input_shape == (spec.batch, spec.in_channels, *spec.input_size)
        assert spec.output_shape == (spec.batch, spec.out_channels, *out)
        c_x, c_y = (spec.out_channels, spec.in_channels) if transposed else (spec.in_channels, spec.out_channels)
        assert spec.weight_shape == (c_y, c_x // spec.groups, *spec.kernel_size)
        m = tuple(min(p) for p in spec.padding)
        assert spec.symmetric_padding == m and spec.is_symmetric == all(lo == hi for lo, hi in spec.padding)
        assert spec.padding_excess == tuple((lo - a, hi - a) for (lo, hi), a in zip(spec.padding, m))
        assert spec.aten_args == (spec.stride, m, spec.dilation, transposed, spec.output_padding, spec.groups)
