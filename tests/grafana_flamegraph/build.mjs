// Bundles entry.jsx and everything it imports into one browser script (and the CSS its imports carry):
//   node build.mjs OUT_FILE.js   (writes OUT_FILE.js and OUT_FILE.css)
import { readFile } from 'node:fs/promises';
import path from 'node:path';

import { build } from 'esbuild';

// Grafana's packages publish ES modules as .mjs files that default-import CommonJS packages marked
// __esModule (`import Scrollbars from 'react-custom-scrollbars-2'`), which works under the interop of
// the bundlers Grafana builds with. esbuild gives every .mjs file Node's interop instead, where such a
// default import is the whole exports object, and React then fails with "Element type is invalid ...
// got: object" (in CustomScrollbar). esbuild decides that from the file name alone, so Grafana's
// files are loaded here under a name without .mjs; everything else about them is unchanged.
const GRAFANA_ESM = /\/node_modules\/@grafana\/[^/]+\/dist\/esm\/.*\.mjs$/;
const NAMESPACE = 'grafana-esm';
const SUFFIX = '.js';

const grafanaEsmAsJs = {
  name: 'grafana-esm-as-js',
  setup(b) {
    const resolve = async (args) => {
      if (args.pluginData === NAMESPACE) return undefined; // our own resolve call below
      const found = await b.resolve(args.path, {
        kind: args.kind,
        importer: args.importer.endsWith(SUFFIX) ? args.importer.slice(0, -SUFFIX.length) : args.importer,
        resolveDir: args.resolveDir,
        pluginData: NAMESPACE,
      });
      if (found.errors.length || !GRAFANA_ESM.test(found.path)) return undefined;
      return { path: found.path + SUFFIX, namespace: NAMESPACE };
    };
    b.onResolve({ filter: /^@grafana\// }, resolve);
    b.onResolve({ filter: /^\.\.?\//, namespace: NAMESPACE }, resolve);
    b.onLoad({ filter: /.*/, namespace: NAMESPACE }, async (args) => {
      const file = args.path.slice(0, -SUFFIX.length);
      return { contents: await readFile(file, 'utf8'), loader: 'js', resolveDir: path.dirname(file) };
    });
  },
};

const out = process.argv[2];
if (!out || !out.endsWith('.js')) {
  console.error('usage: node build.mjs OUT_FILE.js');
  process.exit(2);
}
const started = Date.now();
const result = await build({
  entryPoints: [new URL('./entry.jsx', import.meta.url).pathname],
  outfile: out,
  bundle: true,
  format: 'iife',
  platform: 'browser',
  target: 'chrome110',
  jsx: 'automatic',
  minify: true,
  legalComments: 'none',
  define: { 'process.env.NODE_ENV': '"production"', global: 'globalThis' },
  // Monaco's icon font, named by a CSS file that @grafana/ui's code editor imports; the flame graph
  // draws no icon from it.
  loader: { '.ttf': 'empty' },
  plugins: [grafanaEsmAsJs],
  logLevel: 'warning',
  metafile: true,
});
const bytes = Object.values(result.metafile.outputs).reduce((n, o) => n + o.bytes, 0);
console.log(`${out}: ${bytes} bytes (with its .css) in ${Date.now() - started} ms`);
