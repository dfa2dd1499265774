// Ropewalk UI: live updates over the API's server-sent events (/ui/stream/...), and the job timeline (vis-timeline).
(function () {
  "use strict";
  const rw = {};
  const live = () => document.getElementById("live");

  function follow(kind, query, onView) {
    const es = new EventSource("/ui/stream/" + kind + (query ? "?" + query : ""));
    const name = kind === "jobs" ? "job" : "machine";
    es.addEventListener(name, (e) => onView(JSON.parse(e.data)));
    es.addEventListener("ready", () => { live().className = "live on"; live().dataset.ready = "1"; });
    es.onerror = () => { live().className = "live off"; };
    return es;
  }

  function text(el, sel, value) { const c = el.querySelector(sel); if (c) c.textContent = value; }

  function byState(tasks) {
    const n = {};
    for (const t of tasks) n[t.state] = (n[t.state] || 0) + 1;
    return Object.keys(n).sort().map((s) => s + " " + n[s]).join("  ");
  }

  rw.liveJobs = function () {
    const body = document.querySelector("#jobs tbody");
    follow("jobs", "", (v) => {
      let row = body.querySelector('tr[data-job="' + CSS.escape(v.job) + '"]');
      if (v.deleted) { if (row) row.remove(); return; }
      if (!row) {
        const empty = body.querySelector("tr.empty"); if (empty) empty.remove();
        row = document.createElement("tr");
        row.dataset.job = v.job;
        row.innerHTML = '<td><a></a></td><td class="state"></td><td class="running"></td><td class="bystate"></td><td class="reason"></td>';
        row.querySelector("a").href = "/ui/jobs/" + encodeURIComponent(v.job);
        row.querySelector("a").textContent = v.job;
        body.appendChild(row);
      }
      const running = v.tasks.filter((t) => t.state === "RUNNING").length;
      text(row, ".state", v.state);
      text(row, ".running", running + "/" + v.desired_tasks);
      text(row, ".bystate", byState(v.tasks));
      text(row, ".reason", v.last_reason);
      row.classList.add("changed");
    });
  };

  rw.liveMachines = function () {
    follow("machines", "", (m) => {
      const row = document.querySelector('tr[data-machine="' + CSS.escape(m.id) + '"]');
      if (!row) return;
      text(row, ".status", m.status);
      row.querySelector(".status").className = "status m-" + m.status;
      text(row, ".owner", m.entitlement || "free");
      if (!(m.maintenance || []).length) text(row, ".maint", "");  // a new one: its reason comes with a reload
      row.classList.add("changed");
    });
  };

  // The time slider (_at.html): dragging shows the moment, letting go shows the page as it was then.
  rw.timeSlider = function () {
    const form = document.getElementById("at"), slider = document.getElementById("at-slider");
    const shown = document.getElementById("at-shown");
    if (!form || !slider) return;
    const show = () => { shown.textContent = new Date(Number(slider.value)).toISOString().slice(0, 19).replace("T", " ") + "Z"; };
    slider.addEventListener("input", show);
    slider.addEventListener("change", () => form.submit());
    document.getElementById("at-span").addEventListener("change", () => {
      slider.disabled = !document.getElementById("at-now");  // a new span from now: keep the moment only if one is shown
      form.submit();
    });
  };

  rw.jobPage = function (job, entitlement, live) {
    const box = document.getElementById("timeline");
    const note = document.getElementById("timeline-note");
    let tl = null, items = null, groups = null;

    async function draw() {
      const resp = await fetch("/ui/jobs/" + encodeURIComponent(job) + "/timeline.json");
      if (!resp.ok) { note.textContent = "timeline: " + resp.status; return; }
      const data = await resp.json();
      box.dataset.items = String(data.items.length);
      // a task's runs on distinct machines (a bar "RUNNING v2 on M": a version change on one machine is no move)
      box.dataset.moves = String(new Set(data.items.filter((i) => i.type === "range" && /^RUNNING (v\d+ )?on /.test(i.content))
        .map((i) => i.group + " " + i.content.replace(/^RUNNING (v\d+ )?on /, ""))).size);
      for (const kind of ["failure", "deadline", "maintenance", "intent"])
        box.dataset[kind] = String(data.items.filter((i) => i.className === "op-" + kind).length);
      note.textContent = data.truncated ? ("the " + data.truncated + " oldest items are not drawn") : "";
      if (typeof vis === "undefined") { note.textContent = "vis-timeline is not installed (infra/bootstrap.sh)"; return; }
      if (!tl) {
        items = new vis.DataSet(data.items);
        groups = new vis.DataSet(data.groups);
        // a row's bars on one line; its marks on lines of their own (subgroups, timeline.py), stacked there so
        // marks close in time (intents, a failure and its commands) do not overlap
        tl = new vis.Timeline(box, items, groups, { stack: true, stackSubgroups: true, groupOrder: "order",
                                                    maxHeight: 620, margin: { item: { horizontal: 0, vertical: 3 } },
                                                    tooltip: { followMouse: true }, zoomKey: "" });
        // the job's life, not vis-timeline's default week: from its first item to now (or its last, a future
        // deadline), with a margin, so marks a few seconds apart stand apart
        const starts = data.items.map((i) => i.start), ends = data.items.map((i) => i.end || i.start);
        if (starts.length) {
          const soon = Date.now() + 10 * 60000;  // a deadline or window ahead shows if it is near
          const lo = Math.min(...starts), hi = Math.max(Date.now(), Math.min(soon, Math.max(...ends)));
          const pad = Math.max(5000, (hi - lo) * 0.05);
          tl.setWindow(lo - pad, hi + pad, { animation: false });
        }
      } else {
        groups.update(data.groups);
        items.clear();
        items.add(data.items);
      }
      box.dataset.drawn = String(Date.now());
    }

    async function refreshTasks() {
      const resp = await fetch("/ui/jobs/" + encodeURIComponent(job) + "/tasks");
      if (resp.ok) document.getElementById("tasks-box").innerHTML = await resp.text();
    }

    let pending = null;
    if (live !== false) follow("jobs", "entitlement=" + encodeURIComponent(entitlement), (v) => {
      if (v.job !== job) return;
      // how long after the state record was made the page had it (one clock: the same machine in the tests)
      document.body.dataset.lagMs = String(Date.now() - v.updated_ms);
      const running = v.tasks.filter((t) => t.state === "RUNNING").length;
      const s = document.querySelector("#summary .state");
      if (s) s.textContent = v.state;
      document.getElementById("summary").dataset.running = String(running);
      clearTimeout(pending);  // a burst of changes: one redraw
      pending = setTimeout(() => { refreshTasks(); draw(); }, 150);
    });
    draw();
  };

  window.rw = rw;
})();
