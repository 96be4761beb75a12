(function(){
  var errs = window.__marsErrors = [];
  function rec(m){ errs.push(String(m)); if (document.body) { document.body.dataset.errors = String(errs.length); } }
  window.addEventListener('error', function(e){
    var t = e.target;
    if (t && t !== window && (t.src || t.href)) { rec('resource failed: ' + String(t.src || t.href).slice(0, 80)); }
    else { rec((e.message || 'error') + ' @' + (e.lineno || '?')); }
  }, true);
  window.addEventListener('unhandledrejection', function(e){ rec('unhandled rejection: ' + e.reason); });
  var ce = console.error;
  console.error = function(){ rec(Array.prototype.join.call(arguments, ' ')); return ce.apply(console, arguments); };
})();
