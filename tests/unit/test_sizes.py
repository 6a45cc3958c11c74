import pytest

from gpuswapd.sizes import SizeError, format_size, parse_size


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("21GiB", 21 * 2**30),
        ("512MiB", 512 * 2**20),
        ("21.5G", int(21.5 * 2**30)),
        ("20GB", 20 * 10**9),
        ("1024", 1024),
        ("1 GiB", 2**30),
    ],
)
def test_parse(text: str, nbytes: int) -> None:
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("bad", ["", "GiB", "-1GiB", "21 parsecs", "1e3"])
def test_reject(bad: str) -> None:
    with pytest.raises(SizeError):
        parse_size(bad)


def test_reject_non_string() -> None:
    with pytest.raises(SizeError):
        parse_size(21)  # type: ignore[arg-type]


def test_format() -> None:
    assert format_size(21 * 2**30) == "21.0 GiB"
    assert format_size(512 * 2**20) == "512 MiB"
