"""Ceilings table: datasheet figures, device-name matching, user overrides."""
import re

import pytest

from ridgeline.aggregator import ceilings
from ridgeline.probes.errors import InputError

REQUIRED = ["a100-sxm4-40gb", "a100-sxm4-80gb", "a100-pcie-40gb", "a100-pcie-80gb", "h100-sxm",
            "h100-pcie", "h200-sxm", "h800-sxm", "b200", "l40s", "l4", "a10", "rtx-4090",
            "rtx-5090", "rtx-4080-laptop"]


# the GPUs of the traces people post (issue 13.3)
POSTED = ["v100-sxm2", "v100-pcie", "v100s-pcie", "a10", "l4", "l40s", "rtx-4090", "rtx-5090", "h20",
          "h800-sxm", "b200", "gb200", "mi300x", "mi325x", "mi355x",
          "a800-sxm4-80gb", "a800-pcie-80gb", "a800-pcie-40gb"]      # A800: issue 20.4


def test_table_has_required_models_with_sources():
    t = ceilings.load_table()
    for key in REQUIRED + POSTED:
        c = t[key]
        assert c.hbm_bytes_per_s > 0 and c.peak_flops_per_s("bf16")[0] > 0 and c.flops_per_s["fp32"] > 0
        assert c.source.get("document") and c.source.get("date"), key
        assert c.source.get("url", "").startswith("https://"), key
        assert c.source.get("quoted"), key
        assert c.sm_count and c.memory_bytes


def _numbers(text: str) -> list[float]:
    return [float(x.replace(",", "")) for x in re.findall(r"\d[\d,]*\.?\d*", text)]


@pytest.mark.parametrize("key", sorted(set(ceilings.load_table()) - {"rtx-4080-laptop"}))
def test_figures_are_the_quoted_datasheet_figures(key):
    """Every dense FLOP/s figure and the bandwidth appear in the quoted datasheet text:
    as printed, or as the sparsity figure halved, or per GPU of a two-GPU superchip."""
    c = ceilings.load_table()[key]
    nums = _numbers(c.source["quoted"])

    def quoted(value, units):
        return any(abs(value - n * u * f) <= 0.01 * value for n in nums for u in units for f in (1, 0.5, 0.25))
    for dtype, v in c.flops_per_s.items():
        assert quoted(v, (1e12, 1e15)), (key, dtype, v)
    assert quoted(c.hbm_bytes_per_s, (1e9, 1e12)), (key, c.hbm_bytes_per_s)
    assert quoted(c.memory_bytes, (1e9,)), (key, c.memory_bytes)


def test_volta_has_no_bf16_tensor_path():
    v100 = ceilings.load_table()["v100-sxm2"]
    assert v100.peak_flops_per_s("bf16") == (125e12, "fp16")


def test_datasheet_values_and_ridge_point():
    t = ceilings.load_table()
    h100 = t["h100-sxm"]
    assert h100.hbm_bytes_per_s == 3.35e12
    assert h100.flops_per_s["bf16"] == 989.4e12           # dense (1979 with sparsity)
    assert h100.ridge_point("bf16") == pytest.approx(989.4e12 / 3.35e12)
    assert t["h200-sxm"].hbm_bytes_per_s == 4.8e12
    assert t["h200-sxm"].flops_per_s["bf16"] == h100.flops_per_s["bf16"]
    assert t["a100-sxm4-80gb"].hbm_bytes_per_s == 2039e9
    assert t["a100-sxm4-40gb"].hbm_bytes_per_s == 1555e9
    assert t["b200"].flops_per_s["fp4"] == 2 * t["b200"].flops_per_s["fp8"]
    # A100 has no fp8 path: the peak falls back to bf16 and says so.
    peak, used = t["a100-sxm4-80gb"].peak_flops_per_s("fp8")
    assert (peak, used) == (312e12, "bf16")


@pytest.mark.parametrize("name,mem,sms,key", [
    ("NVIDIA H100 80GB HBM3", 85018279936, 132, "h100-sxm"),
    ("NVIDIA H100 PCIe", None, None, "h100-pcie"),
    ("NVIDIA H100", None, 114, "h100-pcie"),
    ("NVIDIA A100-SXM4-80GB", 84990623744, 108, "a100-sxm4-80gb"),
    ("NVIDIA A100-PG509-200", 42297524224, 108, "a100-sxm4-40gb"),    # HTA AlexNet trace
    ("NVIDIA A100-PG509-200", 85e9, 108, "a100-sxm4-80gb"),
    ("NVIDIA A100 80GB PCIe", None, None, "a100-pcie-80gb"),
    ("NVIDIA GeForce RTX 4080 Laptop GPU", 12450922496, 58, "rtx-4080-laptop"),
    ("NVIDIA B200", 191503138816, 148, "b200"),
    ("NVIDIA H200", None, None, "h200-sxm"),
    ("NVIDIA H800", None, None, "h800-sxm"),
    ("NVIDIA L4", None, None, "l4"),
    ("NVIDIA L40S", None, None, "l40s"),
    ("NVIDIA A10", None, None, "a10"),
    ("NVIDIA GeForce RTX 4090", None, None, "rtx-4090"),
    ("NVIDIA GeForce RTX 5090", None, None, "rtx-5090"),
    ("Tesla V100-SXM2-16GB", 16945512448, 80, "v100-sxm2"),
    ("Tesla V100-PCIE-32GB", None, 80, "v100-pcie"),
    ("Tesla V100S-PCIE-32GB", None, None, "v100s-pcie"),
    ("NVIDIA H20", None, 78, "h20"),
    ("NVIDIA GB200", 199e9, 148, "gb200"),
    ("AMD Instinct MI300X", None, 304, "mi300x"),
    ("AMD Instinct MI300X VF", None, None, "mi300x"),
    ("AMD Instinct MI325X", None, None, "mi325x"),
    ("AMD Instinct MI355X", None, None, "mi355x"),
    ("NVIDIA A800-SXM4-80GB", None, 108, "a800-sxm4-80gb"),
    ("NVIDIA A800 80GB PCIe", None, None, "a800-pcie-80gb"),
    ("NVIDIA A800-PCIE-40GB", None, None, "a800-pcie-40gb"),
    ("NVIDIA A800 PCIe", 40e9, 108, "a800-pcie-40gb"),
])
def test_from_device_name(name, mem, sms, key):
    assert ceilings.from_device_name(name, mem, sms).key == key


def test_unknown_device_is_none_not_a_guess():
    assert ceilings.from_device_name("NVIDIA GeForce GTX 1080") is None
    assert ceilings.from_device_name("NVIDIA A100X") is None


def test_lookup_by_key_name_and_loose_name():
    assert ceilings.lookup("h100-sxm").key == "h100-sxm"
    assert ceilings.lookup("NVIDIA H200 SXM 141GB").key == "h200-sxm"
    assert ceilings.lookup("NVIDIA GeForce RTX 4080 Laptop GPU").key == "rtx-4080-laptop"
    assert ceilings.lookup("l40s").key == "l40s"
    with pytest.raises(InputError, match="unknown GPU"):
        ceilings.lookup("tpu-v5")
    with pytest.raises(InputError, match="ambiguous"):
        ceilings.lookup("a100")


def test_user_table_overrides_and_adds(tmp_path, monkeypatch):
    f = tmp_path / "mine.toml"
    f.write_text('''
[[gpu]]
key = "h100-sxm"
name = "H100 measured"
match = ['^NVIDIA H100 80GB HBM3$']
hbm_bytes_per_s = 2.9e12
flops_per_s = { bf16 = 700e12 }
source = { document = "our calibrate run", date = "2026-11-30" }

[[gpu]]
key = "my-gpu"
name = "Lab GPU"
match = ['^Lab GPU$']
hbm_bytes_per_s = 1e12
flops_per_s = { fp32 = 10e12 }
''')
    t = ceilings.load_table(f)
    assert t["h100-sxm"].hbm_bytes_per_s == 2.9e12 and t["h100-sxm"].origin == str(f)
    assert ceilings.from_device_name("Lab GPU", table=t).key == "my-gpu"
    assert ceilings.from_device_name("NVIDIA H100 80GB HBM3", table=t).gpu == "H100 measured"
    monkeypatch.setenv(ceilings.ENV_USER_TABLE, str(f))
    assert ceilings.load_table()["my-gpu"].flops_per_s == {"fp32": 10e12}


@pytest.mark.parametrize("text,msg", [
    ("not toml [", "not valid TOML"),
    ("x = 1", r"expected \[\[gpu\]\]"),
    ('[[gpu]]\nkey = "a"\nflops_per_s = { bf16 = 1 }\n', "missing 'hbm_bytes_per_s'"),
    ('[[gpu]]\nkey = "a"\nhbm_bytes_per_s = -1\nflops_per_s = { bf16 = 1 }\n', "positive"),
    ('[[gpu]]\nkey = "a"\nhbm_bytes_per_s = 1\nflops_per_s = { bogus = 1 }\n', "unknown dtype"),
    ('[[gpu]]\nkey = "a"\nhbm_bytes_per_s = 1\nflops_per_s = { bf16 = 1 }\nmatch = ["("]\n', "bad match"),
])
def test_bad_user_table_is_one_line_error(tmp_path, text, msg):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(InputError, match=msg) as ei:
        ceilings.load_table(f)
    assert "\n" not in str(ei.value)


def test_missing_user_table(tmp_path):
    with pytest.raises(InputError, match="cannot read"):
        ceilings.load_table(tmp_path / "nope.toml")
