"""Device window folding from NVML records (decoded from pynvml structures with H200 values)."""
import pytest
from support.nvml_samples import h200_raw

from ridgeline.aggregator import device_metrics as dm
from ridgeline.probes import nvml

S = 1_000_000_000


def series():
    recs = []
    for i, (busy, dram, energy_mj, nv_kib, mask, power_mw) in enumerate([
            (100, 74.0, 9_876_543_210, 7_340_032, 0x4, 690_000),
            (100, 80.0, 9_877_233_210, 7_864_320, 0x0, 700_000),
            (97, 77.0, 9_877_923_210, 8_388_608, 0x4 | 0x20, 680_000)]):
        raw = h200_raw()
        raw.update(ts_ns=1_764_500_000_000_000_000 + i * S, energy_mj=energy_mj, clock_event_reasons=mask,
                   power_mw=power_mw)
        raw["utilization"].gpu = busy
        raw["nvlink_fields"][0].value.ullVal = nv_kib
        for m in raw["gpm"]:
            if m.metricId == 10:
                m.value = dram
        recs.append(nvml.device_record(raw))
    return recs


def test_fold_h200_window():
    figs = dm.window_figures(reversed(series()))       # order of arrival does not matter
    f = figs[0]
    assert f["samples"] == 3 and f["gpu_name"] == "NVIDIA H200"
    assert f["gpu_busy_time_pct"] == pytest.approx(99.0) and f["gpu_busy_time_max_pct"] == 100.0
    assert f["gpm_dram_bw_util_pct"] == pytest.approx(77.0) and f["gpm_dram_bw_util_max_pct"] == 80.0
    assert f["power_w"] == pytest.approx(690.0) and f["power_max_w"] == 700.0
    assert f["energy_j"] == pytest.approx(1380.0)                      # 690 W for 2 s
    assert f["nvlink_tx_bytes_per_s"] == pytest.approx(524_288 * 1024)  # 512 MiB/s from the counter
    assert f["nvlink_rx_bytes_per_s"] == pytest.approx(2048 * 1024 * 1024)   # counter unsupported: GPM rate
    assert f["clock_event_reasons"] == ["sw_power_cap", "sw_thermal_slowdown"]
    assert f["clock_slowdown_ratio"] == pytest.approx(2 / 3)
    assert f["sm_clock_min_mhz"] == 1755 and f["source"] == "nvml+gpm"


def test_energy_counter_reset_gives_no_energy():
    recs = series()
    recs[-1]["energy_total_j"] = 5.0
    assert dm.fold(recs)["energy_j"] is None


def test_record_and_prometheus_names_carry_units():
    f = dm.window_figures(series())[0]
    rec = dm.device_record(f)
    assert rec["source"]["probe"] == "nvml" and "busy-time" in rec["source"]["note"]
    prom = dm.prometheus_samples(f)
    names = {n for n, _, _ in prom}
    # Base units and 0..1 ratios, never percent (Prometheus naming conventions).
    assert "ridgeline_gpu_busy_time_ratio" in names and "ridgeline_gpu_dram_bandwidth_utilization_ratio" in names
    assert not any("percent" in n or n.endswith("_mhz") for n in names)
    assert all(0 <= v <= 1 for n, _, v in prom if n.endswith("_ratio"))
    proc = [(l["pid"], v) for n, l, v in prom if n == "ridgeline_gpu_process_memory_used_bytes"]
    assert proc == [("48213", 135_141_163_008.0)]                       # N/A memory is not exposed as 0
    reasons = sorted(l["reason"] for n, l, _ in prom if n == "ridgeline_gpu_clock_event_reason")
    assert reasons == ["sw_power_cap", "sw_thermal_slowdown"]


def test_device_records_are_plain_for_the_wire():
    import msgpack
    recs = series()
    rec = dm.device_record(dm.window_figures(recs)[0])
    assert msgpack.unpackb(msgpack.packb(rec), strict_map_key=False) == rec
    assert msgpack.unpackb(msgpack.packb(recs[0])) == recs[0]


def test_fold_keeps_every_xid_of_the_window_and_the_latest_health():
    recs = series()
    for r, (xids, unc) in zip(recs, (([], 0), ([79, 48], 1), ([13], 1))):
        r.update(nvml.decode_health({"ecc_counts": {(1, 0): unc}, "remapped_rows": (0, unc, unc, 0), "xids": xids}))
    f = dm.window_figures(recs)[0]
    assert (f["xid_errors_count"], f["xid_errors"], f["xid_last"]) == (3, [79, 48, 13], 13)
    assert f["ecc_uncorrected_volatile_errors_total"] == 1 and f["remapped_rows_pending"] is True
    samples = {n: v for n, _, v in dm.prometheus_samples(f)}
    assert samples["ridgeline_gpu_window_xid_errors"] == 3.0 and samples["ridgeline_gpu_last_xid"] == 13.0
    assert samples["ridgeline_gpu_ecc_uncorrected_volatile_errors_total"] == 1.0
    assert samples["ridgeline_gpu_remapped_rows_pending"] == 1.0
    # Unsupported everywhere: no Xid figure at all, never a 0 that reads as healthy.
    g = dm.window_figures(series())[0]
    assert g["xid_errors_count"] is None and "ridgeline_gpu_window_xid_errors" not in {
        n for n, _, _ in dm.prometheus_samples(g)}
