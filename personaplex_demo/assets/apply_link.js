() => {
  if (window.location.search.length < 2) return;
  let tries = 0;
  const press = () => {
    const button = document.getElementById("apply-link");
    if (button) button.click();
    else if (++tries < 50) setTimeout(press, 100);
  };
  press();
}
