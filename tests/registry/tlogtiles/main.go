// Command tlogtiles reads a c2sp.org/tlog-tiles log with Go's golang.org/x/mod/sumdb/tlog and
// sumdb/note (Debian's golang-golang-x-mod-dev), independently of kvgraft, and prints JSON.
//
//	tlogtiles -log URL|DIR -vkey VKEY
//
// It verifies the checkpoint with note.Open, reads every leaf hash through tlog.TileHashReader
// (which authenticates each tile it loads against the checkpoint's tree hash), recomputes the
// root with tlog.TreeHash, then rebuilds every tile the tree has, partial widths included
// (tlog.NewTiles from size 0), with tlog.ReadTileData from a hash store it builds itself from
// those leaf hashes (tlog.StoredHashesForRecordHash), not from the served tiles, and reads every
// entry bundle of the tree (the spec's big-endian uint16 length prefixes, parsed here), each
// entry checked with tlog.RecordHash against its leaf hash. The test
// (tests/registry/test_tiles.py) compares those tiles byte for byte with kvgraft's, and the
// entries with the envelopes published.
//
// Go's tlog names a tile tile/H/L/NNN[.p/W] with the height H in the path and data tiles as
// L = -1, "data"; c2sp.org/tlog-tiles fixes H = 8 and leaves it out, and names entry bundles
// "entries": tile/8/0/x001/234.p/7 is tile/0/x001/234.p/7, tile/8/data/000 is tile/entries/000.
// The NNN encoding (3-digit elements, "x" on all but the last) and .p/W are the same.
//
// Built by the test with GO111MODULE=off GOPATH=/usr/share/gocode: no module download.
package main

import (
	"bytes"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/mod/sumdb/note"
	"golang.org/x/mod/sumdb/tlog"
)

const height = 8

// c2spPath maps Go's tile path to the c2sp.org/tlog-tiles one (see the package comment).
func c2spPath(t tlog.Tile) string {
	p := t.Path()
	prefix := fmt.Sprintf("tile/%d/", t.H)
	if !strings.HasPrefix(p, prefix) {
		panic("unexpected Go tile path " + p)
	}
	rest := strings.TrimPrefix(p, prefix)
	if t.L == -1 {
		rest = "entries/" + strings.TrimPrefix(rest, "data/")
	}
	return "tile/" + rest
}

type source struct {
	base   string
	client *http.Client
}

const maxResource = 256 * (2 + 65535)

func (s *source) fetch(path string) ([]byte, error) {
	if strings.HasPrefix(s.base, "http://") || strings.HasPrefix(s.base, "https://") {
		resp, err := s.client.Get(strings.TrimSuffix(s.base, "/") + "/" + path)
		if err != nil {
			return nil, err
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return nil, fmt.Errorf("GET %s: %s", path, resp.Status)
		}
		data, err := io.ReadAll(io.LimitReader(resp.Body, maxResource+1))
		if err != nil {
			return nil, err
		}
		if len(data) > maxResource {
			return nil, fmt.Errorf("GET %s: too large", path)
		}
		return data, nil
	}
	return os.ReadFile(filepath.Join(s.base, filepath.FromSlash(path)))
}

// tileReader is a tlog.TileReader over the c2sp.org/tlog-tiles paths of a source.
type tileReader struct{ src *source }

func (r tileReader) Height() int { return height }

func (r tileReader) ReadTiles(tiles []tlog.Tile) ([][]byte, error) {
	out := make([][]byte, len(tiles))
	for i, t := range tiles {
		data, err := r.src.fetch(c2spPath(t))
		if err != nil {
			return nil, err
		}
		out[i] = data
	}
	return out, nil
}

func (r tileReader) SaveTiles([]tlog.Tile, [][]byte) {}

// store is a tlog.HashReader over hashes this program computed itself.
type store []tlog.Hash

func (s store) ReadHashes(indexes []int64) ([]tlog.Hash, error) {
	out := make([]tlog.Hash, len(indexes))
	for i, x := range indexes {
		if x < 0 || x >= int64(len(s)) {
			return nil, fmt.Errorf("hash %d not stored", x)
		}
		out[i] = s[x]
	}
	return out, nil
}

type result struct {
	Origin   string            `json:"origin"`
	Size     int64             `json:"size"`
	Root     string            `json:"root"`
	TreeHash string            `json:"tree_hash"`
	Leaves   []string          `json:"leaves"`
	Tiles    map[string]string `json:"tiles"`
	Entries  []string          `json:"entries"`
}

// splitBundle parses an entry bundle of want entries: each a big-endian uint16 length, then
// that many bytes, and nothing after the last.
func splitBundle(data []byte, want int) ([][]byte, error) {
	var entries [][]byte
	for len(entries) < want {
		if len(data) < 2 {
			return nil, fmt.Errorf("ends after %d of %d entries", len(entries), want)
		}
		n := int(binary.BigEndian.Uint16(data))
		if len(data) < 2+n {
			return nil, fmt.Errorf("entry %d claims %d bytes, %d remain", len(entries), n, len(data)-2)
		}
		entries = append(entries, data[2:2+n])
		data = data[2+n:]
	}
	if len(data) != 0 {
		return nil, fmt.Errorf("%d bytes after %d entries", len(data), want)
	}
	return entries, nil
}

func run() error {
	logFlag := flag.String("log", "", "the log's URL prefix or directory")
	vkey := flag.String("vkey", "", "the log's note verifier key")
	flag.Parse()
	if *logFlag == "" || *vkey == "" {
		return errors.New("usage: tlogtiles -log URL|DIR -vkey VKEY")
	}
	src := &source{base: *logFlag, client: &http.Client{Timeout: 30 * time.Second}}

	verifier, err := note.NewVerifier(*vkey)
	if err != nil {
		return fmt.Errorf("vkey: %w", err)
	}
	msg, err := src.fetch("checkpoint")
	if err != nil {
		return err
	}
	n, err := note.Open(msg, note.VerifierList(verifier))
	if err != nil {
		return fmt.Errorf("checkpoint: %w", err)
	}
	lines := strings.Split(n.Text, "\n")
	if len(lines) < 4 {
		return fmt.Errorf("checkpoint text has %d lines", len(lines))
	}
	size, err := strconv.ParseInt(lines[1], 10, 64)
	if err != nil {
		return fmt.Errorf("checkpoint size: %w", err)
	}
	root, err := tlog.ParseHash(lines[2])
	if err != nil {
		return fmt.Errorf("checkpoint root: %w", err)
	}
	tree := tlog.Tree{N: size, Hash: root}

	// Every leaf hash, through tiles authenticated against the tree hash.
	hr := tlog.TileHashReader(tree, tileReader{src})
	leaves := make([]tlog.Hash, 0, size)
	for start := int64(0); start < size; start += 256 {
		var indexes []int64
		for i := start; i < size && i < start+256; i++ {
			indexes = append(indexes, tlog.StoredHashIndex(0, i))
		}
		hs, err := hr.ReadHashes(indexes)
		if err != nil {
			return fmt.Errorf("reading leaf hashes from %d: %w", start, err)
		}
		leaves = append(leaves, hs...)
	}
	th, err := tlog.TreeHash(size, hr)
	if err != nil {
		return fmt.Errorf("tree hash: %w", err)
	}
	if th != root {
		return fmt.Errorf("tree hash %v is not the checkpoint's root %v", th, root)
	}
	// Each served level-0 tile holds the leaf hashes Go read (tlog.HashFromTile).
	for n := int64(0); n*256 < size; n++ {
		w := size - n*256
		if w > 256 {
			w = 256
		}
		t := tlog.Tile{H: height, L: 0, N: n, W: int(w)}
		data, err := src.fetch(c2spPath(t))
		if err != nil {
			return err
		}
		for i := int64(0); i < w; i++ {
			h, err := tlog.HashFromTile(t, data, tlog.StoredHashIndex(0, n*256+i))
			if err != nil {
				return err
			}
			if h != leaves[n*256+i] {
				return fmt.Errorf("%s: hash %d differs", c2spPath(t), i)
			}
		}
	}

	// Rebuild the hash store from the leaf hashes alone, then every tile from it.
	var s store
	for i, leaf := range leaves {
		hs, err := tlog.StoredHashesForRecordHash(int64(i), leaf, s)
		if err != nil {
			return err
		}
		s = append(s, hs...)
	}
	out := result{Origin: lines[0], Size: size, Root: root.String(), TreeHash: th.String(), Tiles: map[string]string{}}
	for _, leaf := range leaves {
		out.Leaves = append(out.Leaves, leaf.String())
	}
	for _, t := range tlog.NewTiles(height, 0, size) {
		data, err := tlog.ReadTileData(t, s)
		if err != nil {
			return err
		}
		out.Tiles[c2spPath(t)] = base64.StdEncoding.EncodeToString(data)
	}
	// Every entry, from the bundles of this tree size, against the leaf hashes authenticated above.
	for n := int64(0); n*256 < size; n++ {
		w := size - n*256
		if w > 256 {
			w = 256
		}
		t := tlog.Tile{H: height, L: -1, N: n, W: int(w)}
		data, err := src.fetch(c2spPath(t))
		if err != nil {
			return err
		}
		entries, err := splitBundle(data, int(w))
		if err != nil {
			return fmt.Errorf("%s: %w", c2spPath(t), err)
		}
		for i, e := range entries {
			if tlog.RecordHash(e) != leaves[n*256+int64(i)] {
				return fmt.Errorf("%s: entry %d does not hash to its leaf", c2spPath(t), i)
			}
			out.Entries = append(out.Entries, base64.StdEncoding.EncodeToString(e))
		}
	}
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	if err := enc.Encode(out); err != nil {
		return err
	}
	_, err = os.Stdout.Write(buf.Bytes())
	return err
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "tlogtiles:", err)
		os.Exit(1)
	}
}
