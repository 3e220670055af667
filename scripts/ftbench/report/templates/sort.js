document.querySelectorAll('table.sortable').forEach(table => {
  table.querySelectorAll('th').forEach((th, col) => th.addEventListener('click', () => {
    const body = table.tBodies[0];
    const asc = th.dataset.order !== 'asc';
    table.querySelectorAll('th').forEach(other => delete other.dataset.order);
    th.dataset.order = asc ? 'asc' : 'desc';
    const key = row => row.cells[col].dataset.value;
    const rows = Array.from(body.rows).sort((a, b) => {
      const x = key(a), y = key(b);
      if (x === '' || y === '') return (x === '') - (y === '');  // empty cells last
      const nx = Number(x), ny = Number(y);
      const cmp = (!isNaN(nx) && !isNaN(ny)) ? nx - ny : x.localeCompare(y);
      return asc ? cmp : -cmp;
    });
    rows.forEach(row => body.appendChild(row));
  }));
});
