// Runs Treescope's inline scripts only once they are whole.
//
// Each Treescope output on these pages carries its scripts in
// <treescope-run-here> elements. Treescope's own definition of that element
// runs the script as soon as the element is connected, or, when the parser
// has not yet added the script, as soon as a script child appears; while the
// page is still loading that child can hold only part of its text (the
// parser yields mid-text on a busy machine), and a part that happens to be
// valid JavaScript runs without error and leaves the output half set up
// (later steps then fail with "insertContent is not a function"). Treescope
// defines the element only when the page has not, so this definition, loaded
// before any output, takes its place: while the document is loading it runs
// each script at DOMContentLoaded, in document order, when every script is
// complete; afterwards (content Treescope inserts) it runs them at once, as
// Treescope does.
(() => {
  if (customElements.get("treescope-run-here") !== undefined) return;
  class RunHere extends HTMLElement {
    connectedCallback() {
      if (document.readyState === "loading") {
        document.addEventListener("DOMContentLoaded", () => this.run(), {
          once: true,
        });
      } else {
        this.run();
      }
    }
    run() {
      const child = this.querySelector("script");
      if (!child || !this.isConnected) return;
      const fn = new Function(child.textContent);
      child.textContent = "";
      fn.call(this);
      this.remove();
    }
  }
  customElements.define("treescope-run-here", RunHere);
})();
