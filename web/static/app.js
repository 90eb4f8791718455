// Progressive enhancement only: every page works without this file.
// Adds a "copy" button to each command block.
"use strict";
document.addEventListener("DOMContentLoaded", function () {
  if (!navigator.clipboard) { return; }
  document.querySelectorAll("pre.cmd").forEach(function (pre) {
    var button = document.createElement("button");
    button.type = "button";
    button.className = "copy";
    button.textContent = "copy";
    button.addEventListener("click", function () {
      navigator.clipboard.writeText(pre.textContent).then(function () {
        button.textContent = "copied";
        setTimeout(function () { button.textContent = "copy"; }, 1500);
      });
    });
    pre.parentNode.appendChild(button);
  });
});
