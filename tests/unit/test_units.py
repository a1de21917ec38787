import pytest
from dsstage.units import human, parse_duration, parse_percent, parse_size


@pytest.mark.parametrize("text,expected", [
    ("3.5TB", 3_500_000_000_000), ("64GB", 64 * 10**9), ("64GiB", 64 * 2**30), ("512M", 512 * 2**20),
    ("100", 100), (4096, 4096), ("1.5 KiB", 1536), ("2t", 2 * 2**40),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "12XB", "-5GB", "", True, -1])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_parse_percent():
    assert parse_percent("90%") == 0.9
    assert parse_percent(" 7.5 % ") == 0.075
    for bad in ("90", "120%", "x%"):
        with pytest.raises(ValueError):
            parse_percent(bad)


def test_human():
    assert human(512) == "512 B"
    assert human(1536) == "1.5 KiB"
    assert human(3 * 2**40) == "3.0 TiB"


@pytest.mark.parametrize("text,seconds", [
    ("90", 90), (90, 90), ("90s", 90), ("10m", 600), ("10 min", 600), ("1.5h", 5400), ("3d", 259200), ("1w", 604800),
])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["soon", "-5", "5 years", True, -1])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError):
        parse_duration(text)
