package main

import (
	"testing"

	"github.com/quotad/quotad/config"
)

// TestDevAcquireExampleNamesADomainOfTheFile: the acquire line quotad dev prints names a
// domain its limits file defines. Under --regions (examples/regions.yaml: platform only) it
// printed the README tour's provider line, which answered unknown_domain (user trial, s11).
func TestDevAcquireExampleNamesADomainOfTheFile(t *testing.T) {
	for file, want := range map[string]string{
		"../../examples/limits.yaml":  "quotad acquire --domain provider --descriptor endpoint=charges",
		"../../examples/regions.yaml": "quotad acquire --domain platform --descriptor route=orders",
	} {
		l, err := config.LoadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		if got := devAcquireExample(l); got != want {
			t.Errorf("%s: %q, want %q", file, got, want)
		}
	}
}
