package config

import (
	"os"
	"path/filepath"
	"testing"
)

// FuzzParse: Parse never panics, and whatever it accepts survives Format and Parse unchanged.
// Run longer with: go test -fuzz FuzzParse ./config/
func FuzzParse(f *testing.F) {
	for _, pattern := range []string{"testdata/valid/*.yaml", "testdata/invalid/*.yaml", "../examples/*.yaml"} {
		files, _ := filepath.Glob(pattern)
		for _, file := range files {
			if data, err := os.ReadFile(file); err == nil {
				f.Add(data)
			}
		}
	}
	f.Add([]byte("domain: x\ndescriptors: [{key: k, value: \"a: b\", rate_limit: {unit: Day, requests_per_unit: 0x10, unit_multiplier: 3}}]\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		l, err := Parse("fuzz.yaml", data)
		if err != nil {
			if l != nil {
				t.Fatal("limits returned with an error")
			}
			return
		}
		checkRoundTrip(t, l)
	})
}
