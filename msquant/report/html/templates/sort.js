(function () {
  var table = document.getElementById("modules");
  if (!table || !table.tBodies.length) { return; }
  var body = table.tBodies[0];
  var headers = Array.prototype.slice.call(table.tHead.rows[0].cells);
  function value(row, index, numeric) {
    var raw = row.cells[index] ? row.cells[index].getAttribute("data-value") : "";
    if (!numeric) { return raw || ""; }
    return raw === "" || raw === null ? null : parseFloat(raw);
  }
  function sortBy(key, descending) {
    var th = headers.filter(function (h) { return h.getAttribute("data-key") === key; })[0];
    if (!th) { return; }
    var index = th.cellIndex;
    var numeric = body.rows.length > 0 && body.rows[0].cells[index] &&
      body.rows[0].cells[index].classList.contains("num");
    var rows = Array.prototype.slice.call(body.rows).filter(function (r) {
      return !r.classList.contains("empty");
    });
    rows.sort(function (a, b) {
      var x = value(a, index, numeric), y = value(b, index, numeric);
      if (x === y) { return 0; }
      if (x === null) { return 1; }
      if (y === null) { return -1; }
      var order = numeric ? x - y : (x < y ? -1 : 1);
      return descending ? -order : order;
    });
    rows.forEach(function (r) { body.appendChild(r); });
    headers.forEach(function (h) { h.removeAttribute("aria-sort"); });
    th.setAttribute("aria-sort", descending ? "descending" : "ascending");
    table.setAttribute("data-sorted-by", (descending ? "-" : "") + key);
  }
  headers.forEach(function (th) {
    function toggle() {
      sortBy(th.getAttribute("data-key"), th.getAttribute("aria-sort") === "ascending");
    }
    th.addEventListener("click", toggle);
    th.addEventListener("keydown", function (e) { if (e.key === "Enter") { toggle(); } });
  });
  var match = /^#sort=(-?)([a-z_]+)$/.exec(window.location.hash);
  if (match) { sortBy(match[2], match[1] === "-"); }
  table.setAttribute("data-sortable", "true");
})();
