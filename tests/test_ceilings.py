"""Ceilings table: datasheet figures, device-name matching, user overrides."""
import pytest

from ridgeline.aggregator import ceilings
from ridgeline.probes.errors import InputError

REQUIRED = ["a100-sxm4-40gb", "a100-sxm4-80gb", "a100-pcie-40gb", "a100-pcie-80gb", "h100-sxm",
            "h100-pcie", "h200-sxm", "h800-sxm", "b200", "l40s", "l4", "a10", "rtx-4090",
            "rtx-5090", "rtx-4080-laptop"]


def test_table_has_required_models_with_sources():
    t = ceilings.load_table()
    for key in REQUIRED:
        c = t[key]
        assert c.hbm_bytes_per_s > 0 and c.flops_per_s["bf16"] > 0 and c.flops_per_s["fp32"] > 0
        assert c.source.get("document") and c.source.get("date"), key
        assert c.sm_count and c.memory_bytes


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
