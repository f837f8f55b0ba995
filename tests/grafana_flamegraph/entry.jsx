// The page's whole program: Grafana's own flame graph component (@grafana/flamegraph), mounted the way
// Grafana's flame graph panel mounts it, on a data frame in Grafana's JSON wire form (schema + data), the
// form Grafana's backend sends the frontend and @grafana/data's dataFrameFromJSON reads.
import { createTheme, dataFrameFromJSON } from '@grafana/data';
import { FlameGraph } from '@grafana/flamegraph';
import { createRoot } from 'react-dom/client';

const theme = createTheme({ colors: { mode: 'light' } });

function mount(element, frameJSON) {
  const data = dataFrameFromJSON(frameJSON);
  createRoot(element).render(<FlameGraph data={data} getTheme={() => theme} stickyHeader={false} />);
  return data;
}

window.grafanaFlameGraph = { mount };
