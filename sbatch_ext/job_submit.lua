--[[
job_submit.lua for sites without one of their own: the dsstage checks only.
Link it beside slurm.conf with dsstage_submit.lua (from the package's Lua directory, as
docs/install.md says) and set JobSubmitPlugins=lua; the catalog is the one
`dsstage export-catalog` keeps in /var/lib/dsstage (its timer runs on every controller), a
catalog beside this file only a development cluster's. Sites with their own job_submit.lua:
see the header of dsstage_submit.lua for the three lines to add.
]]

local here = string.match(debug.getinfo(1, "S").source, "^@(.*/)") or "/etc/slurm/"
package.path = here .. "?.lua;" .. package.path
-- A module that fails to load (purged by configuration management, the package removed) must
-- cost only --dataset: an error here would stop slurmctld ("failed to initialize job_submit
-- plugin"), and with it every submission of the cluster.
local loaded, dsstage = pcall(require, "dsstage_submit")
if loaded then
	table.insert(dsstage.catalog_search, here .. "dsstage_catalog.lua")  -- a development cluster's catalog
else
	slurm.log_error("dsstage: cannot load dsstage_submit.lua (%s): jobs that ask for a dataset are refused " ..
		"until it is back beside job_submit.lua", (string.gsub(tostring(dsstage), "%s+", " ")))
end

-- Whether a job asks for a dataset, told without the module: a --dataset (its SPANK option)
-- or a #BB_LUA dataset= directive.
local function asks_for_dataset(job_desc)
	local env = job_desc.spank_job_env
	if type(env) == "table" then
		for _, entry in pairs(env) do
			local k = type(entry) == "string" and string.match(entry, "^([^=]*)=") or nil
			if k and string.find(string.lower(k), "dsstage", 1, true) then return true end
		end
	end
	for _, text in ipairs({ job_desc.script or "", job_desc.burst_buffer or "" }) do
		if type(text) == "string" and string.find("\n" .. text, "\n#BB_LUA[^\n]*dataset=") then return true end
	end
	return false
end

function slurm_job_submit(job_desc, part_list, submit_uid)
	if not loaded then
		if not asks_for_dataset(job_desc) then return slurm.SUCCESS end
		slurm.log_user("dsstage: datasets cannot be requested now: the controller cannot load dsstage_submit.lua; " ..
			"submit without --dataset (and #BB_LUA dataset=), or ask the admins to reinstall dsstage")
		return slurm.ERROR
	end
	local rc, msg = dsstage.check(job_desc, submit_uid, part_list)
	if rc ~= slurm.SUCCESS then
		slurm.log_user(msg)
	end
	return rc
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
	return slurm.SUCCESS
end

return slurm.SUCCESS
