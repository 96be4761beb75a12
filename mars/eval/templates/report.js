(function(){
  var body = document.body;
  body.dataset.errors = String(window.__marsErrors.length);
  var cards = Array.prototype.slice.call(document.querySelectorAll('details.card'));
  var keys = ['benchmark', 'model', 'workflow', 'correct'];
  var sel = {};
  keys.forEach(function(k){ sel[k] = document.getElementById('f-' + k); });
  var q = document.getElementById('f-q');
  var count = document.getElementById('count');
  function apply(writeHash){
    var shown = 0, ok = 0, needle = q.value.trim().toLowerCase();
    cards.forEach(function(c){
      var vis = keys.every(function(k){ return !sel[k].value || c.dataset[k] === sel[k].value; })
        && (!needle || c.dataset.qid.toLowerCase().indexOf(needle) >= 0);
      c.hidden = !vis;
      if (vis) { shown++; if (c.dataset.correct === 'correct') ok++; }
    });
    count.textContent = shown + ' of ' + cards.length + ' trajectories shown' +
      (shown ? ' \u00b7 ' + ok + ' correct (' + (100 * ok / shown).toFixed(1) + '%)' : '');
    body.dataset.visible = String(shown);
    if (writeHash) {
      var p = new URLSearchParams();
      keys.forEach(function(k){ if (sel[k].value) p.set(k, sel[k].value); });
      if (q.value) p.set('q', q.value);
      try { history.replaceState(null, '', '#' + p.toString()); } catch (e) { /* file:// in some browsers */ }
    }
  }
  function fromHash(){
    var p = new URLSearchParams(location.hash.replace(/^#/, ''));
    keys.forEach(function(k){
      var v = p.get(k);
      if (v !== null && Array.prototype.some.call(sel[k].options, function(o){ return o.value === v; })) sel[k].value = v;
    });
    if (p.get('q') !== null) q.value = p.get('q');
  }
  keys.forEach(function(k){ sel[k].addEventListener('change', function(){ apply(true); }); });
  q.addEventListener('input', function(){ apply(true); });
  window.addEventListener('hashchange', function(){ fromHash(); apply(false); });
  document.getElementById('expand').addEventListener('click', function(){ cards.forEach(function(c){ if (!c.hidden) c.open = true; }); });
  document.getElementById('collapse').addEventListener('click', function(){ cards.forEach(function(c){ c.open = false; }); });
  document.addEventListener('click', function(e){
    if (e.target.tagName === 'IMG' && e.target.closest('figure')) e.target.classList.toggle('zoomed');
  });
  fromHash();
  apply(false);
  window.addEventListener('load', function(){
    var imgs = document.images, loaded = 0;
    for (var i = 0; i < imgs.length; i++) {
      if (imgs[i].complete && imgs[i].naturalWidth > 0) { loaded++; imgs[i].dataset.naturalWidth = String(imgs[i].naturalWidth); }
    }
    body.dataset.imagesTotal = String(imgs.length);
    body.dataset.imagesLoaded = String(loaded);
    body.dataset.errors = String(window.__marsErrors.length);
    body.dataset.errorMessages = window.__marsErrors.join(' | ').slice(0, 2000);
    body.dataset.selfcheck = 'done';
  });
})();
