"""The deployment page's GPU charts in a real Chromium: utilisation in percent and memory used
against total, beside the KV cache, and the MFU estimate under its formula."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Group, User
from django.utils import timezone

from deployments.choices import ReplicaState
from deployments.models import Deployment, Replica, ReplicaMetricsMinute
from registry.models import RegisteredModel
from tests.browser.conftest import log_in
from tests.deployments.test_gpu_panels import H100, version

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_gpu_utilisation_memory_and_mfu_are_drawn(live_server, page, tmp_path):
    user = User.objects.create_user("look", password="pw-look-123456")
    user.groups.add(Group.objects.get(name="viewer"))
    model = RegisteredModel.objects.create(name="llama-8b", task="generate")
    v1 = version(model, 1)
    deployment = Deployment.objects.create(name="chat", model=model, version=v1, replicas=1, resources=H100)
    replica = Replica.objects.create(deployment=deployment, version=v1, node="test", url="http://127.0.0.1:9/1",
                                     state=ReplicaState.READY)
    now = timezone.now().replace(second=0, microsecond=0)
    for offset, util in ((3, 40.0), (2, 80.0), (1, 60.0)):
        ReplicaMetricsMinute.objects.create(
            replica=replica, deployment=deployment, version=v1, start=now - timedelta(minutes=offset), scrapes=4,
            kv_cache_usage_avg=0.5, prompt_tokens=600000, generation_tokens=120000, gpu_devices=2, gpu_scrapes=4,
            gpu_minutes=1, gpu_util_avg=util, gpu_util_max=util, gpu_memory_used_avg=150000.0,
            gpu_memory_total=163116.0)

    log_in(page, live_server.url, "look", "pw-look-123456")
    page.goto(f"{live_server.url}/deployments/chat/")
    page.wait_for_function("() => ['gpu_utilization', 'gpu_memory', 'mfu'].every(k =>"
                           " document.querySelector('#chart-' + k).dataset.points > 0)", timeout=20000)
    utilisation = page.evaluate("document.getElementById('chart-gpu_utilization').data[0].y.filter(v => v !== null)")
    assert sorted(utilisation) == [40, 60, 80]  # percent, from fractions
    ticks = page.locator("#chart-gpu_utilization .ytick text").all_text_contents()
    assert ticks and all(tick.endswith("%") for tick in ticks), ticks
    memory = page.evaluate("document.getElementById('chart-gpu_memory').data.filter(t => t.meta !== 'events')"
                           ".map(t => [t.name, t.y.filter(v => v !== null)])")
    assert memory == [["gpu_memory_used", [150000] * 3], ["gpu_memory_total", [163116] * 3]]
    # 12,000 tokens/s on 2 H100s: 12000 x 2 x 8.03e9 / (2 x 989e12) = 9.74 % each minute.
    mfu = page.evaluate("document.getElementById('chart-mfu').data[0].y.filter(v => v !== null)")
    assert [round(value, 2) for value in mfu] == [9.74] * 3
    assert "MFU = (prompt + generated tokens/s × FLOPs per token)" in page.locator("#mfu-formula").inner_text()
    page.screenshot(path=str(tmp_path / "gpu-charts.png"), full_page=True)
