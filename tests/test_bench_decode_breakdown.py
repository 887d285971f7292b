"""bench.decode --breakdown's critical path of a decode layer, on a made-up kernel timeline: each
kernel's share is its end minus the latest end before it, averaged over the layers (starting at
their attention kernel) of the last token."""
from bench.decode import layer_critical_path


def _token(t0: float, layers: int = 3) -> list[tuple[str, float, float]]:
    """One token: an embedding kernel, `layers` of (attention, product starting before attention
    ends, finish), 6 us apart, then the head."""
    ks = [("embed", t0, 5.0)]
    for layer in range(layers):
        base = t0 + 10 + 30 * layer
        ks += [("decode_attention_kernel<128>", base, 8.0), ("exl3_gemv_kernel<4>", base + 6, 15.0),
               ("gv_finish_kernel", base + 20, 4.0)]
    ks.append(("head", t0 + 10 + 30 * layers, 10.0))
    return ks


def test_layer_critical_path_takes_each_kernels_end_past_the_latest_before_it():
    kernels = _token(0.0) + _token(1000.0)
    got = layer_critical_path(kernels, tokens=2)
    assert got["layers"] == 2  # the last layer's window would run into the head
    # attention: layer 0 ends 13 us after the embedding's end, layer 1 14 after layer 0's finish;
    # the product ends 13 us after attention (it overlaps attention's last 2 us); the finish 3 after.
    assert [s["critical_us"] for s in got["sites"]] == [13.5, 13.0, 3.0]
    assert [s["us"] for s in got["sites"]] == [8.0, 15.0, 4.0]
    assert got["sites"][1]["kernel"].startswith("exl3_gemv_kernel")
    assert got["layer_us"] == 29.5


def test_layer_critical_path_refuses_uneven_layers_and_needs_two_of_them():
    uneven = _token(0.0)
    uneven.insert(5, ("extra_kernel", 45.0, 1.0))  # a fourth kernel in the second layer
    assert "error" in layer_critical_path(uneven, tokens=1)
    assert layer_critical_path(_token(0.0, layers=1), tokens=1) == {}
